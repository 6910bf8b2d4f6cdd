"""Measuring a link: a short bulk TCP transfer between two namespaces, timed in steady state.

The two ends are the programs ``receiver.py`` and ``sender.py`` next to this file, started by
path with this interpreter inside the namespaces (``ip netns exec``). They use the standard
library only, so a measurement does not import torch or lowcomm in either namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
RECEIVER = _HERE / "receiver.py"
SENDER = _HERE / "sender.py"


def _in_namespace(ns: str, program: Path, *args: object) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, str(program), *map(str, args)]


def measure_ns(
    src_ns: str, dst_ns: str, dst_addr: str, rate_bps: int, nbytes: int, warmup_bytes: int
) -> float:
    """Bulk TCP goodput (bits/s) from ``src_ns`` to ``dst_addr`` in ``dst_ns``, steady state.

    The receiver times the bytes after the first ``warmup_bytes`` (the full token bucket and TCP
    start-up), so a short transfer still reads the link's sustained rate. The transfer stops
    after twice its expected time: a link slower than that reads as slow, not as a hang.
    """
    budget = 2.0 * nbytes * 8 / rate_bps + 1.0
    receiver = subprocess.Popen(
        _in_namespace(dst_ns, RECEIVER, dst_addr, warmup_bytes, budget + 1.0),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sender = None
    try:
        assert receiver.stdout is not None
        port_line = receiver.stdout.readline().strip()
        if not port_line.isdigit():
            receiver.kill()
            _, err = receiver.communicate()
            raise RuntimeError(f"measuring receiver failed to start in {dst_ns}: {err.strip()}")
        sender = subprocess.Popen(
            _in_namespace(src_ns, SENDER, dst_addr, port_line, nbytes, budget),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = receiver.communicate(timeout=budget + 10.0)
        _, send_err = sender.communicate(timeout=10.0)
        if receiver.returncode != 0:
            raise RuntimeError(f"measuring receiver in {dst_ns} failed: {err.strip()}")
        if sender.returncode != 0:
            raise RuntimeError(f"measuring sender in {src_ns} failed: {send_err.strip()}")
        return float(json.loads(out.strip().splitlines()[-1])["rate_bps"])
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
