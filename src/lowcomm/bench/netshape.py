"""Run a training run's workers behind a link shaped by the Linux kernel.

Two topologies (docs/benchmarking.md section 2):

- ``shared``: one network namespace whose loopback is shaped with a token bucket (tbf). Every
  worker runs in it and talks over 127.0.0.1, so all traffic of all workers, in both directions,
  shares one link of the given rate. Its loopback gets a 1500 MTU (see ``mtu``).
- ``per-worker``: one namespace per worker, each joined by a veth pair to a bridge that lives in
  its own "switch" namespace. Both ends of every veth pair are shaped (worker egress = uplink,
  switch-port egress = downlink), so each worker has its own full-duplex link of the given rate:
  "M datacenters, each with an X Mbit/s link". Addresses come from ``SUBNET`` and exist only
  inside these namespaces.

Nothing is created in the host's own namespace: every interface is born inside a namespace made
here, so traffic can reach nothing but these namespaces. Deleting the namespaces deletes the
veth pairs and the bridge with them.

Usage::

    with ShapedNetwork("50mbit", "per-worker", workers=2) as net:   # checks the link on entry
        procs = [subprocess.Popen(net.command(r, [sys.executable, "train.py"]),
                                  env={**os.environ, **net.env(r)}) for r in range(2)]
        ...

Only tbf is used: netem (delay, loss), fq and cake are not available in these kernels.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any, Literal

__all__ = [
    "LinkCheckFailed",
    "NetworkUnavailable",
    "ShapedNetwork",
    "SUBNET",
    "check_prerequisites",
    "cleanup_stale",
    "default_burst",
    "parse_rate",
    "parse_size",
]

Topology = Literal["shared", "per-worker"]

#: Private /24 whose addresses are assigned only to interfaces inside namespaces made here.
SUBNET = "10.213.0"
#: Interface name of every worker's uplink in the per-worker topology (same for all ranks, so
#: ``GLOO_SOCKET_IFNAME`` is the same everywhere).
WORKER_IFNAME = "eth0"
#: The bridge's own address inside the switch namespace (a measuring endpoint for 1 worker).
SWITCH_HOST = 254
#: Port workers use for the torch.distributed rendezvous; namespaces are private, so no clash.
DEFAULT_MASTER_PORT = 29500
#: MTU of loopback (the shaped device in the shared topology) and the link-layer header tbf
#: counts in every frame.
_LO_MTU = 65536
_ETH_HEADER = 14
#: tbf queue limit expressed as time at the rate (as in ``tc ... tbf ... latency 50ms``).
TBF_LATENCY = "50ms"

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
}
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


class NetworkUnavailable(RuntimeError):
    """Namespaces or traffic control cannot be used here (not root, no iproute2, no netns...)."""


class LinkCheckFailed(RuntimeError):
    """The shaped link does not carry the requested rate (within the tolerance)."""

    def __init__(self, requested_mbit: float, measured_mbit: float, tolerance: float, where: str,
                 detail: str = ""):
        self.requested_mbit = requested_mbit
        self.measured_mbit = measured_mbit
        self.tolerance = tolerance
        hint = detail or (
            "At high rates the CPU may not keep up with the transfer (a few Gbit/s here); "
            "choose a lower rate, or pass check=False to use the link anyway"
        )
        super().__init__(
            f"link check failed on {where}: measured {measured_mbit:.1f} Mbit/s, requested "
            f"{requested_mbit:.1f} Mbit/s (tolerance {tolerance:.0%}). {hint}"
        )


# --------------------------------------------------------------------------------------------
# Parsing


def parse_rate(s: str) -> int:
    """Bits per second from a tc-style rate: ``10mbit``, ``1gbit``, ``500kbit``, ``200Mbit``.

    Units (case-insensitive): bit, kbit, mbit, gbit, tbit (powers of 1000) and kibit, mibit,
    gibit, tibit (powers of 1024); a bare number is bits/s, as in tc. tc's ``bps`` units mean
    *bytes* per second, a classic trap, so they are refused rather than guessed.
    """
    if not isinstance(s, str):
        raise ValueError(f"rate must be a string like '50mbit', got {s!r}")
    text = s.strip().lower()
    m = re.fullmatch(rf"({_NUMBER})\s*([a-z]*)", text)
    if m is None:
        raise ValueError(f"cannot parse rate {s!r}: expected a number and a unit, like '50mbit'")
    number, unit = m.group(1), m.group(3)
    if unit.endswith("bps"):
        raise ValueError(
            f"rate {s!r}: tc reads '{unit}' as bytes per second; write it in bits, "
            f"e.g. '{number}{unit[:-3]}bit' for {number} {unit[:-3].upper() or ''}bit/s"
        )
    unit = unit or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"rate {s!r}: unknown unit {unit!r}; use one of {', '.join(_RATE_UNITS)}"
        )
    bits = float(number) * _RATE_UNITS[unit]
    if not math.isfinite(bits) or bits < 1:
        raise ValueError(f"rate {s!r} must be at least 1 bit/s")
    return int(round(bits))


def parse_size(s: str | int) -> int:
    """Bytes from a tc-style size: ``64kb`` (= 65536), ``1mb``, ``32k``, ``1500b``, ``1500``."""
    if isinstance(s, bool):
        raise ValueError(f"size must be bytes or a string like '64kb', got {s!r}")
    if isinstance(s, int):
        if s < 1:
            raise ValueError(f"size must be positive, got {s}")
        return s
    if not isinstance(s, str):
        raise ValueError(f"size must be bytes or a string like '64kb', got {s!r}")
    m = re.fullmatch(rf"({_NUMBER})\s*([a-z]*)", s.strip().lower())
    if m is None or m.group(3) not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {s!r}: expected a number with b, kb, mb or gb (bytes), like '64kb'"
        )
    value = float(m.group(1)) * _SIZE_UNITS[m.group(3)]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"size {s!r} must be at least 1 byte")
    return int(round(value))


def default_burst(rate_bps: int, mtu: int) -> int:
    """Token-bucket depth in bytes: 4 ms at the rate, at least 32 KiB and two full frames.

    tbf drops any packet larger than its bucket that it cannot segment, so the bucket must hold
    the largest frame the device sends. 4 ms of traffic (the classic rate/HZ rule with HZ=250)
    keeps the average rate accurate at high rates despite timer slack.
    """
    return max(rate_bps // 8 // 250, 2 * (mtu + 64), 32 * 1024)


# --------------------------------------------------------------------------------------------
# Running ip / tc


class _CommandFailed(RuntimeError):
    pass


def _run(argv: list[str], timeout: float = 20.0) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise NetworkUnavailable(f"{argv[0]!r} not found; install iproute2") from e
    if done.returncode != 0:
        raise _CommandFailed(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _list_namespaces() -> list[str]:
    try:
        out = _run(["ip", "netns", "list"])
    except (_CommandFailed, NetworkUnavailable):
        return []
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespace_pids(ns: str) -> list[int]:
    try:
        out = _run(["ip", "netns", "pids", ns])
    except (_CommandFailed, NetworkUnavailable):
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited already; it only waits to be reaped.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_namespace_processes(ns: str, grace_s: float = 1.0) -> None:
    """Stop what still runs inside ``ns`` (workers of this run), so the namespace really dies."""
    own = {os.getpid(), os.getppid()}
    pids = [p for p in _namespace_pids(ns) if p not in own]
    if not pids:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.02)
        pids = [p for p in pids if _alive(p)]
        if not pids:
            return


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    try:
        _run(["ip", "netns", "del", ns])
    except _CommandFailed:
        if ns in _list_namespaces():
            raise


def check_prerequisites() -> None:
    """Raise :class:`NetworkUnavailable` unless namespaces, veth, bridge and tbf all work here."""
    if os.geteuid() != 0:
        raise NetworkUnavailable(
            "shaped networks need root (network namespaces and tc); run as root, e.g. with sudo, "
            "or skip the network benchmarks"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkUnavailable(
                f"'{tool}' not found on PATH; install iproute2 (apt-get install iproute2)"
            )
    probe = f"lowcomm-{os.getpid()}-probe{threading.get_ident() % 10000}"
    other = probe + "b"
    step = "create a network namespace (`ip netns add`)"
    try:
        _run(["ip", "netns", "add", probe])
        step = "add a tbf qdisc (`tc qdisc add ... tbf`, kernel module sch_tbf)"
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "10mbit",
              "burst", "131072", "latency", TBF_LATENCY])
        step = "create a bridge (kernel module bridge)"
        _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
        step = "create a veth pair between namespaces (kernel module veth)"
        _run(["ip", "netns", "add", other])
        _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
              "netns", other])
    except _CommandFailed as e:
        raise NetworkUnavailable(
            f"cannot {step}: {e}. Shaped networks need a kernel with network namespaces, veth, "
            "bridge and sch_tbf, and permission to use them (root, not inside a restricted "
            "container); skip the network benchmarks here"
        ) from e
    finally:
        for ns in (other, probe):
            try:
                _delete_namespace(ns)
            except (_CommandFailed, NetworkUnavailable):
                pass


def cleanup_stale(prefix: str = "lowcomm", *, include_live: bool = False) -> list[str]:
    """Delete namespaces left behind by killed runs; returns the names it deleted.

    Names are ``{prefix}-{pid}-...``; a namespace is stale when that pid no longer runs (or
    always, with ``include_live=True``). Processes still inside a stale namespace are stopped.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    removed = []
    for ns in _list_namespaces():
        m = pattern.match(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        if not include_live and (pid == os.getpid() or _alive(pid)):
            continue
        try:
            _delete_namespace(ns)
            removed.append(ns)
        except (_CommandFailed, NetworkUnavailable):
            pass
    return removed


# --------------------------------------------------------------------------------------------
# Measuring a link: a tiny bulk TCP transfer between two namespaces

_RECEIVER = r"""
import json, socket, sys, time
addr, warmup, deadline_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addr, 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
end = time.monotonic() + deadline_s
srv.settimeout(max(end - time.monotonic(), 0.1))
conn, _ = srv.accept()
buf = bytearray(1 << 20)
total, first, mark, last = 0, None, None, None
while True:
    left = end - time.monotonic()
    if left <= 0:
        break
    conn.settimeout(left)
    try:
        n = conn.recv_into(buf)
    except socket.timeout:
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
start = mark if mark is not None and last[0] - mark[0] > 0.05 else first
rate = 0.0 if start is None or last[0] <= start[0] else (last[1] - start[1]) * 8 / (last[0] - start[0])
print(json.dumps({"bytes": total, "rate_bps": rate, "steady": start is mark}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
addr, port, nbytes, deadline_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
end = time.monotonic() + deadline_s
s = socket.create_connection((addr, port), timeout=5)
chunk = memoryview(bytes(1 << 18))
sent = 0
while sent < nbytes and time.monotonic() < end:
    s.settimeout(max(end - time.monotonic(), 0.05))
    try:
        sent += s.send(chunk[: min(len(chunk), nbytes - sent)])
    except socket.timeout:
        break
s.close()
"""


def _measure_ns(src_ns: str, dst_ns: str, dst_addr: str, rate_bps: int, nbytes: int,
                warmup_bytes: int) -> float:
    """Bulk TCP goodput (bits/s) from ``src_ns`` to ``dst_addr`` in ``dst_ns``, steady state.

    The receiver times the bytes after the first ``warmup_bytes`` (the full token bucket and TCP
    start-up), so a short transfer still reads the link's sustained rate. The transfer stops
    after twice its expected time: a link slower than that reads as slow, not as a hang.
    """
    budget = 2.0 * nbytes * 8 / rate_bps + 1.0
    receiver = subprocess.Popen(
        ["ip", "netns", "exec", dst_ns, sys.executable, "-c", _RECEIVER, dst_addr,
         str(warmup_bytes), str(budget + 1.0)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
            ["ip", "netns", "exec", src_ns, sys.executable, "-c", _SENDER, dst_addr, port_line,
             str(nbytes), str(budget)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        out, err = receiver.communicate(timeout=budget + 10.0)
        _, send_err = sender.communicate(timeout=10.0)
        if receiver.returncode != 0:
            raise RuntimeError(f"measuring receiver in {dst_ns} failed: {err.strip()}")
        if sender.returncode != 0:
            raise RuntimeError(f"measuring sender in {src_ns} failed: {send_err.strip()}")
        result = json.loads(out.strip().splitlines()[-1])
        return float(result["rate_bps"])
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------------------------
# The shaped network


class ShapedNetwork:
    """Namespaces and shaped links for the workers of one run; a context manager.

    Args:
        rate: link rate, tc style (``"50mbit"``). In ``shared`` it is the total of all traffic
            of all workers; in ``per-worker`` each worker gets it up and, separately, down.
        topology: ``"shared"`` or ``"per-worker"`` (see the module docstring).
        workers: number of ranks (namespaces in ``per-worker``).
        burst: token-bucket depth (bytes or tc size like ``"64kb"``); default
            :func:`default_burst`.
        name_prefix: namespaces are named ``{prefix}-{pid}-{n}-{role}``.
        check: on entry, measure the link and raise :class:`LinkCheckFailed` unless the
            measured rate is within ``tolerance`` of ``rate``.
        tolerance: relative tolerance of the check.
        check_seconds: length of the check's transfer at the requested rate.
        mtu: MTU of the shaped device (the veths, or loopback in ``shared``); 1500 like a
            real WAN link. TCP goodput is then ~95.6% of the line rate per-worker and ~93-94%
            shared (where the ACKs cross the same link); the link check accepts both. 65536
            leaves loopback as it is (goodput ~99.9%), but 64 KiB frames make slow links
            erratic: 2.0-3.0 Mbit/s measured through 3mbit, against 2.8 steady with 1500.
        master_port: port for ``MASTER_PORT`` in :meth:`env`.
        kill_leftovers: on teardown, stop processes still running in the namespaces (they
            are this run's workers; a namespace does not die while a process is inside).
    """

    _counter = 0
    _counter_lock = threading.Lock()

    def __init__(
        self,
        rate: str,
        topology: Topology = "shared",
        workers: int = 2,
        burst: str | int | None = None,
        name_prefix: str = "lowcomm",
        *,
        check: bool = True,
        tolerance: float = 0.10,
        check_seconds: float = 1.5,
        mtu: int | None = None,
        master_port: int = DEFAULT_MASTER_PORT,
        kill_leftovers: bool = True,
    ) -> None:
        self.rate_bps = parse_rate(rate)
        self.rate = rate
        if topology not in ("shared", "per-worker"):
            raise ValueError(f"topology must be 'shared' or 'per-worker', got {topology!r}")
        self.topology: Topology = topology
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        if topology == "per-worker" and workers > SWITCH_HOST - 1:
            raise ValueError(
                f"per-worker topology supports at most {SWITCH_HOST - 1} workers "
                f"(one /24), got {workers}"
            )
        self.workers = workers
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", name_prefix):
            raise ValueError(
                f"name_prefix must be letters, digits, '_' or '.', starting with a letter "
                f"(no '-', which separates the pid), got {name_prefix!r}"
            )
        self.name_prefix = name_prefix
        max_mtu = _LO_MTU if topology == "shared" else 65535  # veth's ceiling
        if mtu is not None and (isinstance(mtu, bool) or not 576 <= mtu <= max_mtu):
            raise ValueError(f"mtu must be in [576, {max_mtu}] for {topology}, got {mtu!r}")
        self.mtu = mtu if mtu is not None else 1500
        device_mtu = self.mtu
        self.burst_bytes = parse_size(burst) if burst is not None else default_burst(
            self.rate_bps, device_mtu)
        if self.burst_bytes < device_mtu + _ETH_HEADER:
            # Measured here: tbf drops every frame larger than its bucket (0 Mbit/s through a
            # 1513 B bucket on a 1500 MTU veth), and on loopback a bucket of 64 KiB, just under
            # one 64 KiB frame, let 320 Mbit/s through a 200mbit limit.
            raise ValueError(
                f"burst {self.burst_bytes} B is smaller than one frame on the shaped device "
                f"({device_mtu + _ETH_HEADER} B: MTU {device_mtu} + {_ETH_HEADER}); tbf would "
                f"drop or mis-shape traffic. Use at least {device_mtu + _ETH_HEADER} B, or leave "
                f"burst=None for {default_burst(self.rate_bps, device_mtu)} B"
            )
        if check_seconds <= 0:
            raise ValueError(f"check_seconds must be positive, got {check_seconds}")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
        self.check = check
        self.tolerance = tolerance
        self.check_seconds = check_seconds
        self.master_port = master_port
        self.kill_leftovers = kill_leftovers

        with ShapedNetwork._counter_lock:
            serial = ShapedNetwork._counter
            ShapedNetwork._counter += 1
        self._base = f"{name_prefix}-{os.getpid()}-{serial}"
        if topology == "shared":
            self._worker_ns = [f"{self._base}-shared"] * workers
            self._switch_ns: str | None = None
        else:
            self._worker_ns = [f"{self._base}-w{r}" for r in range(workers)]
            self._switch_ns = f"{self._base}-sw"
        self._created: list[str] = []  # namespaces, in creation order
        self._lock = threading.RLock()
        self._entered = False
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}
        self.measured_mbit: float | None = None

    # ---- addresses and commands ----------------------------------------------------------

    @property
    def master_addr(self) -> str:
        """Address of rank 0 as the other ranks reach it (``MASTER_ADDR``)."""
        return "127.0.0.1" if self.topology == "shared" else self.address(0)

    @property
    def ifname(self) -> str:
        """Interface carrying the shaped traffic inside a worker's namespace."""
        return "lo" if self.topology == "shared" else WORKER_IFNAME

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network owns (worker namespaces, then the switch)."""
        names = list(dict.fromkeys(self._worker_ns))
        return names + ([self._switch_ns] if self._switch_ns else [])

    def namespace(self, rank: int) -> str:
        """Namespace of ``rank`` (the same one for every rank in ``shared``)."""
        self._check_rank(rank)
        return self._worker_ns[rank]

    def address(self, rank: int) -> str:
        """IPv4 address of ``rank`` as its peers reach it."""
        self._check_rank(rank)
        return "127.0.0.1" if self.topology == "shared" else f"{SUBNET}.{rank + 1}"

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside ``rank``'s namespace (environment and cwd are kept)."""
        if not argv:
            raise ValueError("argv must not be empty")
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for a torch.distributed worker of ``rank`` (``env://`` rendezvous).

        Sets the rendezvous variables and pins gloo (and tensorpipe/NCCL sockets) to the shaped
        interface: inside a namespace, gloo's default of resolving the hostname would otherwise
        pick an address peers cannot reach.
        """
        self._check_rank(rank)
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.workers),
            "LOWCOMM_ADDR": self.address(rank),  # for servers a worker advertises (torchft's stores)
            "GLOO_SOCKET_IFNAME": self.ifname,
            "TP_SOCKET_IFNAME": self.ifname,
            "NCCL_SOCKET_IFNAME": self.ifname,
        }

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.workers:
            raise ValueError(f"rank must be in [0, {self.workers}), got {rank!r}")

    # ---- measuring -----------------------------------------------------------------------

    def measure(self, rank_a: int = 0, rank_b: int | None = None, nbytes: int | None = None,
                seconds: float = 2.0) -> float:
        """Measured Mbit/s of a bulk TCP transfer from ``rank_a`` to ``rank_b`` (TCP goodput).

        ``rank_b`` defaults to rank 1 in ``per-worker`` (or the switch itself with one worker:
        that path crosses rank_a's uplink) and to the shared namespace in ``shared``. The
        transfer is ``nbytes`` (default: the bucket plus ``seconds`` at the requested rate, and
        at least 6 frames) and gives up after twice its expected time; the rate is timed after
        the bucket's initial burst and TCP start-up. This is goodput: with 1500 B frames it is
        ~95.6% of the line rate per-worker and ~93-94% shared (ACKs share the link there).
        """
        if not self._entered or self._closed:
            raise RuntimeError("measure() needs an active network: use it inside `with`")
        self._check_rank(rank_a)
        src = self.namespace(rank_a)
        if self.topology == "shared":
            if rank_b is not None:
                self._check_rank(rank_b)
            dst, addr = src, "127.0.0.1"
        elif rank_b is None and self.workers == 1:
            assert self._switch_ns is not None
            dst, addr = self._switch_ns, f"{SUBNET}.{SWITCH_HOST}"
        else:
            rank_b = (1 if rank_a == 0 else 0) if rank_b is None else rank_b
            self._check_rank(rank_b)
            if rank_b == rank_a:
                raise ValueError("rank_a and rank_b share a namespace: that path is not shaped")
            dst, addr = self.namespace(rank_b), self.address(rank_b)
        # The first `burst` bytes cross at once (the bucket starts full); time what follows,
        # after a further 10% for TCP start-up.
        if nbytes is None:
            # At least a few frames past the burst, or one lost 64 KiB frame skews a slow link.
            frame = self.mtu + _ETH_HEADER
            nbytes = self.burst_bytes + max(int(self.rate_bps / 8 * seconds), 6 * frame)
        if nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        warmup = min(self.burst_bytes + (nbytes - self.burst_bytes) // 10, nbytes // 2)
        bps = _measure_ns(src, dst, addr, self.rate_bps, nbytes, warmup)
        return bps / 1e6

    # ---- set-up --------------------------------------------------------------------------

    def __enter__(self) -> ShapedNetwork:
        with self._lock:
            if self._entered:
                raise RuntimeError("a ShapedNetwork can be entered only once; make a new one")
            self._entered = True
            if os.geteuid() != 0:
                raise NetworkUnavailable(
                    "shaped networks need root (network namespaces and tc); run as root or "
                    "skip the network benchmarks"
                )
            for tool in ("ip", "tc"):
                if shutil.which(tool) is None:
                    raise NetworkUnavailable(f"'{tool}' not found on PATH; install iproute2")
            self._install_handlers()
            atexit.register(self.close)
        try:
            if self.topology == "shared":
                self._setup_shared()
            else:
                self._setup_per_worker()
            if self.check:
                self._check_link()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ip(self, *args: str) -> None:
        if self._closed:  # a signal tore us down while setting up: create nothing more
            raise RuntimeError("ShapedNetwork was torn down during set-up")
        try:
            _run(list(args))
        except _CommandFailed as e:
            raise NetworkUnavailable(
                f"setting up the shaped network failed: {e}. Is this a kernel with namespaces, "
                "veth, bridge and sch_tbf? check_prerequisites() tells what is missing"
            ) from e

    def _add_namespace(self, ns: str) -> None:
        with self._lock:
            self._created.append(ns)  # before creating: a signal in between still removes it
        self._ip("ip", "netns", "add", ns)
        self._ip("ip", "-n", ns, "link", "set", "lo", "up")

    def _tbf(self, ns: str, dev: str) -> None:
        self._ip("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                 "latency", TBF_LATENCY)

    def _setup_shared(self) -> None:
        ns = self._worker_ns[0]
        self._add_namespace(ns)
        if self.mtu != _LO_MTU:
            self._ip("ip", "-n", ns, "link", "set", "lo", "mtu", str(self.mtu))
        self._tbf(ns, "lo")

    def _setup_per_worker(self) -> None:
        sw = self._switch_ns
        assert sw is not None
        self._add_namespace(sw)
        self._ip("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("ip", "-n", sw, "addr", "add", f"{SUBNET}.{SWITCH_HOST}/24", "dev", "br0")
        self._ip("ip", "-n", sw, "link", "set", "br0", "up")
        for rank, ns in enumerate(self._worker_ns):
            port = f"p{rank}"
            self._add_namespace(ns)
            # Silence IPv6 (router solicitations, DAD) on the shaped links; best effort.
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                            "net.ipv6.conf.all.disable_ipv6=1",
                            "net.ipv6.conf.default.disable_ipv6=1"],
                           capture_output=True)
            # Created inside the switch namespace with its peer moved straight into the
            # worker's: no interface ever exists in the host's namespace.
            self._ip("ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", WORKER_IFNAME, "mtu", str(self.mtu), "netns", ns)
            self._ip("ip", "-n", sw, "link", "set", port, "master", "br0")
            self._ip("ip", "-n", sw, "link", "set", port, "up")
            self._ip("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev",
                     WORKER_IFNAME)
            self._ip("ip", "-n", ns, "link", "set", WORKER_IFNAME, "up")
            self._tbf(ns, WORKER_IFNAME)  # uplink: worker -> switch
            self._tbf(sw, port)  # downlink: switch -> worker

    def _check_link(self) -> None:
        if self.topology == "shared":
            where = f"loopback of {self.namespace(0)}"
        elif self.workers == 1:
            where = f"{self.namespace(0)} -> switch"
        else:
            where = f"{self.namespace(0)} -> {self.namespace(1)}"
        requested = self.rate_bps / 1e6
        try:
            measured = self.measure(0, None, seconds=self.check_seconds)
        except RuntimeError as e:  # no transfer at all: the path is broken
            raise LinkCheckFailed(requested, 0.0, self.tolerance, where, detail=str(e)) from e
        self.measured_mbit = measured
        if abs(measured - requested) > self.tolerance * requested:
            raise LinkCheckFailed(requested, measured, self.tolerance, where)

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace (and with them every veth and the bridge). Idempotent."""
        in_main = threading.current_thread() is threading.main_thread()
        blocked = {signal.SIGINT, signal.SIGTERM}
        # Hold the signals off while tearing down, so a second Ctrl-C cannot cut it short;
        # they are delivered (to the restored handlers) right after.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if in_main else None
        try:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                errors = []
                for ns in reversed(self._created):
                    try:
                        if not self.kill_leftovers:
                            _run(["ip", "netns", "del", ns])
                        else:
                            _delete_namespace(ns)
                    except (_CommandFailed, NetworkUnavailable) as e:
                        errors.append(str(e))
                self._created.clear()
                self._restore_handlers()
                atexit.unregister(self.close)
                if errors:
                    print("lowcomm.netshape: teardown left something behind (remove it with "
                          "cleanup_stale()): " + "; ".join(errors), file=sys.stderr)
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit still runs
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:
                continue  # the process chose to ignore it (or it is not Python's): keep that
            self._previous_handlers[sig] = previous
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous_handlers.items():
            # Only undo our own handler: someone may have installed theirs on top since.
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        self.close()  # also restores the previous handlers
        if callable(previous):
            previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # die of the signal, as the process would have

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("up" if self._entered else "new")
        return (f"ShapedNetwork(rate={self.rate!r}, topology={self.topology!r}, "
                f"workers={self.workers}, burst={self.burst_bytes}, {state})")


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lowcomm.bench.netshape",
        description="Set up a kernel-shaped network, measure it, print, tear it down.",
    )
    parser.add_argument("--rate", default="50mbit", help="tc-style rate, e.g. 50mbit, 1gbit")
    parser.add_argument("--topology", choices=["shared", "per-worker"], default="shared")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--burst", default=None, help="bucket depth, e.g. 64kb (default: auto)")
    parser.add_argument("--mtu", type=int, default=None,
                        help="MTU of the shaped device (default 1500; 65536 keeps loopback's)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each measurement")
    parser.add_argument("--repeat", type=int, default=1, help="measurements to take")
    parser.add_argument("--no-check", action="store_true", help="skip the link check on entry")
    parser.add_argument("--hold", action="store_true",
                        help="keep the network up until Ctrl-C (prints how to enter it)")
    parser.add_argument("--cleanup-stale", action="store_true",
                        help="delete namespaces of dead runs (prefix lowcomm) and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    try:
        if args.cleanup_stale:
            removed = cleanup_stale("lowcomm")
            print(json.dumps(removed) if args.json else
                  ("removed: " + " ".join(removed) if removed else "nothing stale"))
            return 0
        check_prerequisites()
        with ShapedNetwork(args.rate, args.topology, args.workers, burst=args.burst,
                           mtu=args.mtu, check=not args.no_check) as net:
            results = [net.measure(seconds=args.seconds) for _ in range(args.repeat)]
            report = {
                "rate": args.rate,
                "requested_mbit": net.rate_bps / 1e6,
                "topology": net.topology,
                "workers": net.workers,
                "burst_bytes": net.burst_bytes,
                "mtu": net.mtu,
                "check_mbit": net.measured_mbit,
                "measured_mbit": results,
                "namespaces": net.namespaces,
                "master_addr": net.master_addr,
            }
            if args.json:
                print(json.dumps(report))
            else:
                got = ", ".join(f"{m:.1f}" for m in results)
                print(f"{net.topology} x{net.workers} at {args.rate} "
                      f"(requested {net.rate_bps / 1e6:g} Mbit/s, burst {net.burst_bytes} B): "
                      f"measured {got} Mbit/s")
            if args.hold:
                for r in range(net.workers):
                    print(f"rank {r}: {' '.join(net.command(r, ['bash']))}  "
                          f"(address {net.address(r)})")
                print("holding; Ctrl-C tears down", flush=True)
                while True:
                    time.sleep(3600)
    except (NetworkUnavailable, LinkCheckFailed, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
