"""Receiving end of a link measurement: accept one TCP connection and time what arrives.

Run by path inside a namespace (standard library only, so nothing of lowcomm is imported):
``python receiver.py ADDR WARMUP_BYTES DEADLINE_S``. It prints the port it listens on, then one
JSON line ``{"bytes", "rate_bps", "steady"}``. The rate is timed from the first byte past
``WARMUP_BYTES`` (the token bucket's initial burst and TCP start-up), or from the first byte
when too little followed it; it stops at EOF or at the deadline.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def _listen(addr: str) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, 0))
    srv.listen(1)
    return srv


def receive(conn: socket.socket, warmup: int, end: float) -> dict[str, object]:
    """Read until EOF or ``end`` (monotonic); the goodput in bits/s after ``warmup`` bytes."""
    buf = bytearray(1 << 20)
    total, first, mark, last = 0, None, None, None
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        conn.settimeout(left)
        try:
            n = conn.recv_into(buf)
        except TimeoutError:
            break
        if n == 0:
            break
        now = time.perf_counter()
        if first is None:
            first = (now, 0)
        total += n
        last = (now, total)
        if mark is None and total >= warmup:
            mark = (now, total)
    # time from the mark only if enough followed it to be a steady reading
    start = mark if mark is not None and last[0] - mark[0] > 0.05 else first
    rate = 0.0
    if start is not None and last[0] > start[0]:
        rate = (last[1] - start[1]) * 8 / (last[0] - start[0])
    return {"bytes": total, "rate_bps": rate, "steady": start is mark}


def main(argv: list[str]) -> int:
    """``ADDR WARMUP_BYTES DEADLINE_S``: listen, print the port, receive, print the result."""
    addr, warmup, deadline_s = argv[0], int(argv[1]), float(argv[2])
    srv = _listen(addr)
    print(srv.getsockname()[1], flush=True)
    end = time.monotonic() + deadline_s
    srv.settimeout(max(end - time.monotonic(), 0.1))
    conn, _ = srv.accept()
    print(json.dumps(receive(conn, warmup, end)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
