""":class:`ShapedNetwork`: the namespaces and shaped links of one run, as a context manager.

Set-up creates every interface inside a namespace made here (never in the host's), shapes it
with tbf (the building is :class:`~lowcomm.lab.netshape.links.LinkBuilder`'s), and measures
the link; teardown deletes the namespaces, which takes the veth pairs
and the bridge with them, on normal exit, on an exception, on SIGINT/SIGTERM and at exit.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from typing import Literal

from .errors import LinkCheckFailed
from .links import SUBNET, SWITCH_HOST, WORKER_IFNAME, LinkBuilder
from .measure import measure_ns
from .namespaces import delete_namespaces, require_root_and_iproute2
from .teardown import SignalTeardown, signals_held
from .units import ETH_HEADER, LO_MTU, TBF_LATENCY, default_burst, parse_rate, parse_size

Topology = Literal["shared", "per-worker"]

#: Port workers use for the torch.distributed rendezvous; namespaces are private, so no clash.
DEFAULT_MASTER_PORT = 29500


def _check_shape(topology: str, workers: int, name_prefix: str, mtu: int | None) -> int:
    """Validate the topology arguments; returns the MTU of the shaped device."""
    if topology not in ("shared", "per-worker"):
        raise ValueError(f"topology must be 'shared' or 'per-worker', got {topology!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if topology == "per-worker" and workers > SWITCH_HOST - 1:
        raise ValueError(
            f"per-worker topology supports at most {SWITCH_HOST - 1} workers "
            f"(one /24), got {workers}"
        )
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", name_prefix):
        raise ValueError(
            f"name_prefix must be letters, digits, '_' or '.', starting with a letter "
            f"(no '-', which separates the pid), got {name_prefix!r}"
        )
    max_mtu = LO_MTU if topology == "shared" else 65535  # veth's ceiling
    if mtu is not None and (isinstance(mtu, bool) or not 576 <= mtu <= max_mtu):
        raise ValueError(f"mtu must be in [576, {max_mtu}] for {topology}, got {mtu!r}")
    return mtu if mtu is not None else 1500


def _check_burst(burst: str | int | None, rate_bps: int, mtu: int) -> int:
    """The token bucket's depth in bytes, refused when it cannot hold one frame."""
    burst_bytes = parse_size(burst) if burst is not None else default_burst(rate_bps, mtu)
    if burst_bytes < mtu + ETH_HEADER:
        # Measured here: tbf drops every frame larger than its bucket (0 Mbit/s through a
        # 1513 B bucket on a 1500 MTU veth), and on loopback a bucket of 64 KiB, just under
        # one 64 KiB frame, let 320 Mbit/s through a 200mbit limit.
        raise ValueError(
            f"burst {burst_bytes} B is smaller than one frame on the shaped device "
            f"({mtu + ETH_HEADER} B: MTU {mtu} + {ETH_HEADER}); tbf would "
            f"drop or mis-shape traffic. Use at least {mtu + ETH_HEADER} B, or leave "
            f"burst=None for {default_burst(rate_bps, mtu)} B"
        )
    return burst_bytes


class ShapedNetwork:
    """Namespaces and shaped links for the workers of one run; a context manager.

    Args:
        rate: link rate, tc style (``"50mbit"``). In ``shared`` it is the total of all traffic
            of all workers; in ``per-worker`` each worker gets it up and, separately, down.
        topology: ``"shared"`` or ``"per-worker"`` (see the package docstring).
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
        self.mtu = _check_shape(topology, workers, name_prefix, mtu)
        self.topology: Topology = topology
        self.workers = workers
        self.name_prefix = name_prefix
        self.burst_bytes = _check_burst(burst, self.rate_bps, self.mtu)
        if check_seconds <= 0:
            raise ValueError(f"check_seconds must be positive, got {check_seconds}")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
        self.check = check
        self.tolerance = tolerance
        self.check_seconds = check_seconds
        self.master_port = master_port
        self.kill_leftovers = kill_leftovers
        self._name_namespaces()
        self._created: list[str] = []  # namespaces, in creation order
        self._lock = threading.RLock()
        self._entered = False
        self._closed = False
        self._signals = SignalTeardown(self.close)
        self.measured_mbit: float | None = None

    def _name_namespaces(self) -> None:
        with ShapedNetwork._counter_lock:
            serial = ShapedNetwork._counter
            ShapedNetwork._counter += 1
        self._base = f"{self.name_prefix}-{os.getpid()}-{serial}"
        if self.topology == "shared":
            self._worker_ns = [f"{self._base}-shared"] * self.workers
            self._switch_ns: str | None = None
        else:
            self._worker_ns = [f"{self._base}-w{r}" for r in range(self.workers)]
            self._switch_ns = f"{self._base}-sw"

    # ---- addresses and commands ----------------------------------------------------------

    @property
    def master_addr(self) -> str:
        """Address of rank 0 as the other ranks reach it (``MASTER_ADDR``)."""
        return "127.0.0.1" if self.topology == "shared" else self.address(0)

    @property
    def switch(self) -> str:
        """The switch's namespace (``per-worker``): a service every worker reaches runs here."""
        if self._switch_ns is None:
            raise ValueError("a shared topology has no switch")
        return self._switch_ns

    @property
    def switch_addr(self) -> str:
        """The switch's own address on the bridge, as every worker reaches it."""
        return f"{SUBNET}.{SWITCH_HOST}"

    @property
    def uplink(self) -> str:
        """The tbf settings of a worker's uplink (``tc qdisc add dev IF root tbf ...``)."""
        return f"rate {self.rate_bps}bit burst {self.burst_bytes} latency {TBF_LATENCY}"

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
            # for servers a worker advertises (torchft's stores)
            "LOWCOMM_ADDR": self.address(rank),
            "GLOO_SOCKET_IFNAME": self.ifname,
            "TP_SOCKET_IFNAME": self.ifname,
            "NCCL_SOCKET_IFNAME": self.ifname,
        }

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.workers:
            raise ValueError(f"rank must be in [0, {self.workers}), got {rank!r}")

    # ---- measuring -----------------------------------------------------------------------

    def measure(
        self,
        rank_a: int = 0,
        rank_b: int | None = None,
        nbytes: int | None = None,
        seconds: float = 2.0,
    ) -> float:
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
        src, dst, addr = _path(self, rank_a, rank_b)
        # The first `burst` bytes cross at once (the bucket starts full); time what follows,
        # after a further 10% for TCP start-up.
        if nbytes is None:
            # At least a few frames past the burst, or one lost 64 KiB frame skews a slow link.
            frame = self.mtu + ETH_HEADER
            nbytes = self.burst_bytes + max(int(self.rate_bps / 8 * seconds), 6 * frame)
        if nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        warmup = min(self.burst_bytes + (nbytes - self.burst_bytes) // 10, nbytes // 2)
        return measure_ns(src, dst, addr, self.rate_bps, nbytes, warmup) / 1e6

    # ---- set-up --------------------------------------------------------------------------

    def __enter__(self) -> ShapedNetwork:
        with self._lock:
            if self._entered:
                raise RuntimeError("a ShapedNetwork can be entered only once; make a new one")
            self._entered = True
            require_root_and_iproute2()
            self._signals.install()
            atexit.register(self.close)
        try:
            links = LinkBuilder(self.rate_bps, self.burst_bytes, self.mtu, self._record, self._torn)
            if self.topology == "shared":
                links.shared(self._worker_ns[0])
            else:
                assert self._switch_ns is not None
                addresses = [self.address(r) for r in range(self.workers)]
                links.per_worker(self._switch_ns, list(zip(self._worker_ns, addresses)))
            if self.check:
                self._check_link()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _record(self, ns: str) -> None:
        """Note namespace ``ns`` as ours, before it is created: teardown then removes it even if
        a signal arrives in between."""
        with self._lock:
            self._created.append(ns)

    def _torn(self) -> bool:
        return self._closed

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
        with signals_held(), self._lock:
            if self._closed:
                return
            self._closed = True
            errors = delete_namespaces(reversed(self._created), self.kill_leftovers)
            self._created.clear()
            self._signals.restore()
            atexit.unregister(self.close)
            if errors:
                print(
                    "lowcomm.lab.netshape: teardown left something behind (remove it with "
                    "cleanup_stale()): " + "; ".join(errors),
                    file=sys.stderr,
                )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("up" if self._entered else "new")
        return (
            f"ShapedNetwork(rate={self.rate!r}, topology={self.topology!r}, "
            f"workers={self.workers}, burst={self.burst_bytes}, {state})"
        )


def _path(net: ShapedNetwork, rank_a: int, rank_b: int | None) -> tuple[str, str, str]:
    """(source namespace, destination namespace, destination address) of a measurement."""
    net._check_rank(rank_a)
    src = net.namespace(rank_a)
    if net.topology == "shared":
        if rank_b is not None:
            net._check_rank(rank_b)
        return src, src, "127.0.0.1"
    if rank_b is None and net.workers == 1:
        assert net._switch_ns is not None
        return src, net._switch_ns, f"{SUBNET}.{SWITCH_HOST}"
    rank_b = (1 if rank_a == 0 else 0) if rank_b is None else rank_b
    net._check_rank(rank_b)
    if rank_b == rank_a:
        raise ValueError("rank_a and rank_b share a namespace: that path is not shaped")
    return src, net.namespace(rank_b), net.address(rank_b)
