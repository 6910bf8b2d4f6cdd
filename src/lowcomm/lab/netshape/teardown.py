"""Tearing a network down on Ctrl-C or SIGTERM, then letting the signal do what it would have.

A shaped network must not outlive its run: its namespaces would keep holding addresses and
workers. :class:`SignalTeardown` installs handlers for SIGINT and SIGTERM that call a teardown
function first and then hand the signal to whatever handler was there before.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def in_main_thread() -> bool:
    """Signal handlers and masks can only be changed from the main thread."""
    return threading.current_thread() is threading.main_thread()


class SignalTeardown:
    """Run ``teardown`` on SIGINT/SIGTERM, then chain to the previous handler."""

    def __init__(self, teardown: Callable[[], None]) -> None:
        self._teardown = teardown
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Put our handler in place of the current ones (main thread only; else a no-op)."""
        if not in_main_thread():
            return  # atexit still tears down
        for sig in _SIGNALS:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:
                continue  # the process chose to ignore it (or it is not Python's): keep that
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put the previous handlers back, unless someone installed theirs on top of ours."""
        if not in_main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._teardown()  # expected to call restore()
        if callable(previous):
            previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # die of the signal, as the process would have


class signals_held:
    """Context manager: SIGINT and SIGTERM wait while the body runs (so a second Ctrl-C
    cannot cut a teardown short); they are delivered right after. Main thread only."""

    def __enter__(self) -> None:
        self._old = None
        if in_main_thread():
            self._old = signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old)
