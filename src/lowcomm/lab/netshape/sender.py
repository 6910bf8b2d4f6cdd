"""Sending end of a link measurement: push zero bytes to a receiver as fast as TCP allows.

Run by path inside a namespace (standard library only): ``python sender.py ADDR PORT NBYTES
DEADLINE_S``. It stops after ``NBYTES`` or at the deadline, whichever comes first, so a link
slower than expected reads as slow rather than hanging the caller.
"""

from __future__ import annotations

import socket
import sys
import time


def send(addr: str, port: int, nbytes: int, deadline_s: float) -> int:
    """Send up to ``nbytes`` to ``addr:port`` within ``deadline_s``; returns the bytes sent."""
    end = time.monotonic() + deadline_s
    s = socket.create_connection((addr, port), timeout=5)
    chunk = memoryview(bytes(1 << 18))
    sent = 0
    while sent < nbytes and time.monotonic() < end:
        s.settimeout(max(end - time.monotonic(), 0.05))
        try:
            sent += s.send(chunk[: min(len(chunk), nbytes - sent)])
        except TimeoutError:
            break
    s.close()
    return sent


def main(argv: list[str]) -> int:
    """``ADDR PORT NBYTES DEADLINE_S``."""
    send(argv[0], int(argv[1]), int(argv[2]), float(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
