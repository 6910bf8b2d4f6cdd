"""How long a site's heartbeat channel lags a lighthouse that was killed and started again: a
`lowcomm lighthouse` is started, beaten every 50 ms by three clients, SIGKILLed, left away
for AWAY_S, started again on the same port; each client's lag is the time from the port
accepting again to that client's first answer (any answer: a keyed front refusing an
unsealed beat has answered). A site back from an outage waits `settle_s` before it asks, so
the lag must stay under it. Clients:

- `lowcomm`: a gRPC channel with the options a keyed site's beats use (lowcomm.elastic.link);
- `grpc-default`: the same channel with gRPC's own backoff (the control: before 69dcca0);
- `torchft`: torchft's LighthouseClient, which an open (unkeyed) site's beats go by.

Prints one JSON row per trial and a summary row.

    python benchmarks/reconnect_after_restart.py [TRIALS] [AWAY_S]
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import grpc
from torchft.coordination import LighthouseClient

from lowcomm.elastic.link import BEAT, RECONNECT_MAX_MS, settle_s

BEAT_EVERY_S = 0.05


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(port: int, secret: Path) -> subprocess.Popen:
    """A keyed lighthouse on ``port`` (its own session: killed with its children)."""
    cmd = [sys.executable, "-m", "lowcomm.cli", "lighthouse", "--host", "127.0.0.1",
           "--port", str(port), "--secret-file", str(secret), "--run-id", "probe"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def start_open(port: int) -> subprocess.Popen:
    """An open lighthouse (no secret) on ``port``."""
    cmd = [sys.executable, "-m", "lowcomm.cli", "lighthouse", "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip


def wait_open(port: int, limit_s: float = 30.0) -> float:
    """Polls until ``port`` accepts a TCP connection; the monotonic time it first did."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return time.monotonic()
        except OSError:
            time.sleep(0.005)
    raise SystemExit(f"the lighthouse on port {port} did not open within {limit_s:g} s")


class Beater:
    """Beats every BEAT_EVERY_S by ``send``; records when each beat was answered."""

    def __init__(self, send) -> None:
        self.send, self.answered, self.stop = send, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(BEAT_EVERY_S):
            try:
                self.send()
            except grpc.RpcError as e:  # a keyed front answers a bare beat with a refusal
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    continue
            except Exception:  # torchft's client: an open lighthouse accepts every beat
                continue
            self.answered.append(time.monotonic())

    def first_after(self, t: float, limit_s: float = 20.0) -> float | None:
        """Seconds from ``t`` to this client's first answer after it (None: none in time)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            later = [a for a in self.answered if a >= t]
            if later:
                return later[0] - t
            time.sleep(0.005)
        return None


def channel(port: int, ours: bool) -> grpc.Channel:
    """A channel to the lighthouse: with the site's reconnect options, or gRPC's own."""
    options = [("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)] if ours else []  # fmt: skip
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def bare_beat(c: grpc.Channel):
    """A heartbeat without a seal on ``c`` (a keyed front answers it with a refusal)."""
    return lambda: c.unary_unary(BEAT)(b"", timeout=1.0)


def beaters_of(kind: str, port: int) -> dict[str, Beater]:
    """The clients that beat a ``kind`` ("keyed" or "open") lighthouse on ``port``."""
    if kind == "keyed":
        return {"lowcomm": Beater(bare_beat(channel(port, True))),
                "grpc-default": Beater(bare_beat(channel(port, False)))}  # fmt: skip
    client = LighthouseClient(f"http://127.0.0.1:{port}", timedelta(seconds=1))
    return {"torchft": Beater(lambda: client.heartbeat("probe-site"))}


def trial(away_s: float, tmp: Path) -> dict:
    """One kill-and-restart of a keyed and of an open lighthouse, each client's lag."""
    secret = tmp / "secret"
    secret.write_text(os.urandom(16).hex())
    row: dict = {"away_s": away_s}
    keyed_port, open_port = free_port(), free_port()
    lighthouses = {"keyed": (keyed_port, lambda: start(keyed_port, secret)),
                   "open": (open_port, lambda: start_open(open_port))}  # fmt: skip
    for kind, (port, launch) in lighthouses.items():
        proc = launch()
        wait_open(port)
        beaters = beaters_of(kind, port)
        time.sleep(1.0)  # every channel connected and beating
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(away_s)
        proc = launch()
        back = wait_open(port)
        for name, b in beaters.items():
            lag = b.first_after(back)
            row[name] = None if lag is None else round(lag, 3)
        for b in beaters.values():
            b.stop.set()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return row


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    away_s = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(trials):
            rows.append(trial(away_s, Path(d)))
            print(json.dumps(rows[-1]), flush=True)
    summary: dict = {"trials": trials, "settle_s(heartbeat_s=0.2)": round(settle_s(0.2), 3)}
    for name in ("lowcomm", "grpc-default", "torchft"):
        lags = [r[name] for r in rows if r[name] is not None]
        summary[name] = {"max": max(lags, default=None),
                         "median": round(statistics.median(lags), 3) if lags else None,
                         "unanswered": trials - len(lags)}  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
