"""What the engine counts: bytes, syncs, time blocked (``SyncStats``), seconds per stage of the
syncs (``SyncTimes``), and the timing contexts that keep that arithmetic out of the logic."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..transport import ByteMeter, Transport
from .state import RunState, StatePart


@dataclass
class SyncStats:
    """What a user sees in ``engine.stats``: bytes, syncs and time blocked on the network."""

    syncs: int = 0
    fragment_syncs: int = 0
    inner_steps: int = 0  # the run's step this site is at (quorum rounds may skip some)
    trained_steps: int = 0  # inner steps this site actually took
    payload_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    control_bytes_sent: int = 0
    control_bytes_received: int = 0
    buffer_bytes_sent: int = 0  # module buffers averaged or broadcast at syncs
    buffer_bytes_received: int = 0
    final_syncs: int = 0  # consolidations when leaving the block
    final_sync_bytes_sent: int = 0  # their training bytes (also counted in bytes_sent)
    blocked_s: float = 0.0
    outer_s: float = 0.0
    peak_bytes_per_sync: int = 0
    left_out_syncs: int = 0  # fragment syncs in which some worker was left out
    left_out_here: int = 0  # ... of which this worker was the one left out
    replica_checks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (for summaries)."""
        return dataclasses.asdict(self)

    def saved(self) -> dict[str, Any]:
        """The counters a checkpoint carries (``extra`` is rebuilt from the run)."""
        return {k: v for k, v in self.as_dict().items() if k != "extra"}

    def load(self, saved: dict[str, Any]) -> None:
        """Continue the counters of :meth:`saved`."""
        for k, v in saved.items():
            setattr(self, k, v)

    def read_meters(
        self,
        meter: ByteMeter,
        buffer_meter: ByteMeter | None,
        inner: Transport | None,
        times: SyncTimes,
    ) -> None:
        """Copy the byte and time totals of the transports' meters into the counters."""
        self.payload_bytes, self.bytes_sent, self.bytes_received = (
            meter.payload_bytes,
            meter.sent_bytes,
            meter.received_bytes,
        )
        self.control_bytes_sent = meter.control_sent_bytes
        self.control_bytes_received = meter.control_received_bytes
        self.blocked_s = meter.blocked_s
        self.extra["sync_times_s"] = dataclasses.asdict(times)
        if inner is not None:  # DDP inside a worker: parts shared with its ranks
            self.extra["inner_bytes_sent"] = inner.meter.sent_bytes
        if buffer_meter is not None:
            self.buffer_bytes_sent = buffer_meter.sent_bytes
            self.buffer_bytes_received = buffer_meter.received_bytes


@dataclass
class SyncTimes:
    """Seconds spent in each stage of the syncs so far (``engine.sync_times``).

    Encode, outer and merge run on the caller's thread; collective and decode_sum wherever the
    exchange runs (the comm thread when overlapped). ``caller`` is the caller's time in syncs
    outside waits on an exchange and ``exchange`` the exchanges' own time: their sum is the
    work of the syncs, which the stages never exceed.
    """

    encode: float = 0.0  # pseudo-gradient, error compensation, codec encode
    collective: float = 0.0  # the wire exchange, control flags and buffers included
    decode_sum: float = 0.0  # decode the peers' payloads and average them
    outer: float = 0.0  # outer optimizer step on the global copy
    merge: float = 0.0  # the result into the local weights
    caller: float = 0.0
    exchange: float = 0.0

    @property
    def total(self) -> float:
        """The work of the syncs, on whichever thread it ran."""
        return self.caller + self.exchange

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Add the seconds of the block to stage ``name`` (with :attr:`on_device`, its GPU
        work too: the device is waited for at the stage's edges)."""
        if self.on_device:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.on_device:
                torch.cuda.synchronize()
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

    #: time the stages' GPU work too (benchmarks: it adds a host synchronisation per edge)
    on_device: ClassVar[bool] = False
    #: the stages, in the order a sync runs them
    STAGES: ClassVar[tuple[str, ...]] = ("encode", "collective", "decode_sum", "outer", "merge")

    def stages(self) -> dict[str, float]:
        """Each stage's seconds so far, and the total (for deltas over a round)."""
        return {**{s: getattr(self, s) for s in self.STAGES}, "total": self.total}


class Unblocked:
    """The caller's seconds in a block minus its waits on the network (``meter.blocked_s``)."""

    def __init__(self, meter: ByteMeter) -> None:
        self.meter = meter
        self.seconds = 0.0
        self._t0 = self._blocked0 = 0.0

    def __enter__(self) -> Unblocked:
        self._t0, self._blocked0 = time.perf_counter(), self.meter.blocked_s
        return self

    def __exit__(self, *exc: Any) -> None:
        elapsed = time.perf_counter() - self._t0
        self.seconds = elapsed - (self.meter.blocked_s - self._blocked0)


def register_counters(state: RunState, stats: SyncStats, meter: ByteMeter) -> None:
    """Declare the counters: checkpointed so totals continue, never rolled back by leaving."""
    state.register("stats", StatePart(stats.saved, stats.load, kept=False))
    state.register(
        "meter", StatePart(meter.as_dict, lambda v: meter.load_dict(v or {}), kept=False)
    )
