"""Imported only by the workers' fork server (it is in its preload list, and nothing else
imports it): ties the server's life to the launcher that started it.

Workers forked from the server are its children, not the launcher's, and torch ties each
worker's life to its parent (SIGINT when the parent dies). The server itself outlives a killed
launcher while any worker holds its pipe, so a ``kill -9`` of the launcher would leave the
workers training on as orphans; with this, the server gets SIGTERM when the launcher dies, and
its workers their SIGINT (they leave at once: see ``entry.run_entry``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def tie_to_parent() -> bool:
    """Ask the kernel to send this process SIGTERM when its parent dies (Linux; elsewhere, or
    where the call fails, nothing). True when it is tied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # the parent may have died before the call: then nobody would signal us
    if os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


TIED = tie_to_parent()
