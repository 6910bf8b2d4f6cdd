"""The collectives of one sync: every worker's control flags, each fragment's exchange through
the aggregator, then the module's floating buffers — built as one job that runs blocking or on
the transport's comm thread."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn as nn

from .. import _buffers
from ..aggregate import Aggregator, Encoded, Reduced
from ..transport import Transport
from .fragment import Fragment
from .stats import SyncStats, SyncTimes

if TYPE_CHECKING:
    from ..elastic import Runner

T = TypeVar("T")

# Columns of the per-exchange control flags (one int64 row per worker): then P unsent counts
# from UNSENT on, then P validity flags (see flags_row).
DONE, STEP, NONFINITE, UNSENT = 0, 1, 2, 3


@dataclass
class Event:
    """What one exchange (all fragments sent at one step) brought back."""

    flags: torch.Tensor  # [M, 3 + P] int64, every worker's control flags (without_validity)
    reduced: dict[int, Reduced]  # fragment -> averaged pseudo-gradient
    buffers: torch.Tensor | None = None  # averaged / broadcast floating buffers, flat FP32

    @property
    def nonfinite_workers(self) -> int:
        """How many workers' updates were non-finite (left out of this exchange), in any of its
        fragments: as their flags say, or as their payloads said where the check stayed on
        the device until then."""
        flagged = {w for w, bad in enumerate(self.flags[:, NONFINITE].tolist()) if bad}
        return len(flagged.union(*(r.nonfinite for r in self.reduced.values())))


def flags_row(
    step: int, done: bool, nonfinite: bool, unsent: list[int], sent: list[int] | None = None
) -> torch.Tensor:
    """This worker's control flags: has it left its loop, its step, was its update finite,
    unsent inner steps per fragment, and per fragment whether its payload in this exchange
    is valid (1 or 0; -1 not known on the host: the payload's own flag says)."""
    sent = sent if sent is not None else [-1] * len(unsent)
    return torch.tensor([int(done), step, int(nonfinite)] + unsent + sent, dtype=torch.int64)


def _validity_at(flags: torch.Tensor) -> int:
    """The first validity column of gathered flags (flags_row: P unsent counts, P validities)."""
    return UNSENT + (flags.shape[1] - UNSENT) // 2


def unsent_of(flags: torch.Tensor) -> torch.Tensor:
    """The unsent-steps columns of gathered flags (one per fragment)."""
    return flags[:, UNSENT : _validity_at(flags)]


def without_validity(flags: torch.Tensor) -> torch.Tensor:
    """Gathered flags as a result keeps them: [M, 3 + P], without the validity columns, which
    only the exchange that carried them reads (a checkpoint's in-flight results keep their
    layout from before those columns)."""
    return flags[:, : _validity_at(flags)]


def senders_of(flags: torch.Tensor, p: int, world: int) -> int | None:
    """How many workers' payloads of fragment ``p`` are valid, as every worker's flags say
    (no read of the device); None where some row does not know, or ``flags`` is not one row
    per worker of a group of ``world``."""
    if flags.shape[0] != world:
        return None
    col = flags[:, _validity_at(flags) + p].tolist()
    return None if min(col) < 0 else sum(col)


def _joined(out: list[Reduced]) -> Reduced:
    """One fragment's buckets' results as one (the unapplied parts, per tensor, in order)."""
    unapplied = [u for r in out for u in r.unapplied or []]
    held = any(r.unapplied is not None for r in out)
    norms: dict[int, float] | None = None
    if all(r.norms is not None for r in out):  # tracked: each sender's over every bucket
        norms = {}
        for r in out:
            for w, v in (r.norms or {}).items():
                norms[w] = norms.get(w, 0.0) + v
    return Reduced(
        torch.cat([r.mean for r in out]),
        min(r.valid_workers for r in out),
        unapplied if held else None,
        norms,
        tuple(sorted(set().union(*(r.nonfinite for r in out)))),
        any(r.left_out_here for r in out),
    )


class Exchange:
    """Builds the job of one sync on the engine's transports, aggregator and counters."""

    def __init__(
        self,
        model: nn.Module,
        frags: list[Fragment],
        *,
        buffers: str,
        aggregator: Aggregator,
        transport: Transport,
        buffer_transport: Transport,
        stats: SyncStats,
        times: SyncTimes,
        runner: Runner | None = None,
        most_steps: int = 0,
    ) -> None:
        self.model, self.frags, self.buffers = model, frags, buffers
        # the most inner steps a contribution's weight may claim (0: no bound): 2 H, a site
        # that missed one sync and carries its work in; a site's count is its own word
        self.most_steps = most_steps
        self.aggregator, self.transport, self.buffer_transport = (
            aggregator,
            transport,
            buffer_transport,
        )
        self.stats, self.times = stats, times
        self.runner = runner  # elastic: collectives on the live quorum, settled and retried
        # quorum rounds: contributions weighted by the inner steps they hold (see weights)
        self.weighted = runner is not None and runner.rounds is not None

    def on_group(self, tag: str, collectives: Callable[[Transport, Transport], T]) -> T:
        """Run ``collectives`` on the run's transports (training, buffers); with membership,
        on the live quorum's, retried among the survivors until committed (``tag`` names the
        sync, the same on every site)."""
        if self.runner is None:
            return collectives(self.transport, self.buffer_transport)
        return self.runner.run(tag, collectives)

    def flags(
        self,
        step: int,
        done: bool,
        nonfinite: bool = False,
        covered: dict[int, int] | None = None,
        sent: dict[int, int] | None = None,
    ) -> torch.Tensor:
        """This worker's flags now (see :func:`flags_row`); ``covered``: the inner steps each
        fragment sent now holds (its count is reset by encoding); ``sent``: whether each
        fragment sent now is valid (1, 0, or -1 where the payload's flag alone knows). Flags
        made before encoding (a worker that has left its loop: it may still send its last
        steps) say -1 for every fragment."""
        covered = covered or {}
        valid = [sent.get(f.index, 0) for f in self.frags] if sent is not None else None
        unsent = [covered.get(f.index, f.unsent) for f in self.frags]
        return flags_row(step, done, nonfinite, unsent, valid)

    def gather_flags(self, mine: torch.Tensor, tag: str) -> torch.Tensor:
        """Every worker's flags, blocking (a worker that has left only mirrors this)."""
        return self.transport.blocking(
            lambda: self.on_group(tag, lambda t, _: torch.stack(t.all_gather(mine, control=True)))
        )

    def job(
        self,
        encoded: dict[int, list[Encoded]],
        mine: torch.Tensor | None,
        flags: torch.Tensor | None,
        tag: str,
        with_buffers: bool = True,
    ) -> Callable[[], Event]:
        """The collectives of one sync: control flags (unless given), each fragment's exchange,
        then the floating buffers (read now, on the caller's thread)."""
        buffers = None
        if with_buffers and self.buffers != "local":
            buffers = _buffers.float_flat(self.model)
        return lambda: self.on_group(
            tag, lambda t, bt: self._run(t, bt, encoded, mine, flags, buffers)
        )

    def _run(
        self,
        transport: Transport,
        buffer_transport: Transport,
        encoded: dict[int, list[Encoded]],
        mine: torch.Tensor | None,
        flags: torch.Tensor | None,
        buffers: torch.Tensor | None,
    ) -> Event:
        aggregator, times = self.aggregator, self.times
        t0, collective0, exchanging = time.perf_counter(), aggregator.collective_s, 0.0
        gathered = flags if mine is None else torch.stack(transport.all_gather(mine, control=True))
        sent0 = transport.meter.sent_bytes
        reduced = {}
        for p, parts in encoded.items():
            if self.runner is not None:  # an attempt may fail half-way: keep the bytes intact
                parts = [dataclasses.replace(e, payload=e.payload.clone()) for e in parts]
            t1 = time.perf_counter()
            w = self.weights(gathered, p) if self.weighted else None
            senders = senders_of(gathered, p, transport.world_size)
            for e in parts:  # an all-reduce need not read its count from the device
                e.senders = senders
            out = [aggregator.exchange(e, transport, w) for e in parts]
            exchanging += time.perf_counter() - t1
            reduced[p] = self._by_site(out[0] if len(out) == 1 else _joined(out))
        self.stats.peak_bytes_per_sync = max(
            self.stats.peak_bytes_per_sync, transport.meter.sent_bytes - sent0
        )
        assert gathered is not None
        if buffers is not None and self.runner is not None:
            buffers = buffers.clone()  # reduced in place
        buffers = self.exchange_buffers(buffers, buffer_transport)
        event = Event(without_validity(gathered), reduced, buffers)
        # what exchange() spent outside its collectives is decoding and summing
        decoding = exchanging - (aggregator.collective_s - collective0)
        elapsed = time.perf_counter() - t0
        times.decode_sum += decoding
        times.collective += elapsed - decoding
        times.exchange += elapsed
        return event

    def _by_site(self, reduced: Reduced) -> Reduced:
        """``reduced`` with its senders' norms keyed by site, not group rank (a result may be
        applied after the members changed: overlap)."""
        if reduced.norms is None or self.runner is None or self.runner.current is None:
            return reduced
        members = self.runner.current.members
        return dataclasses.replace(reduced, norms={members[r]: v for r, v in reduced.norms.items()})

    def weights(self, flags: torch.Tensor, p: int) -> list[float] | None:
        """Each worker's weight in fragment ``p``'s mean (0 when it sent none or a non-finite
        one), by the run's ``weighting``: ``steps``, the inner steps h its contribution holds;
        ``plain``, 1 each; ``normalized``, 1/h (each pseudo-gradient taken per step, the mean
        then scaled back to the harmonic mean of the h). None, the plain mean, when every
        contribution holds the same steps: every rule is then the plain mean, which keeps the
        bits of a lock-step run. The counts are clamped to [0, ``most_steps``]."""
        assert self.runner is not None
        steps = flags[:, UNSENT + p].clone()
        steps[flags[:, NONFINITE] != 0] = 0
        steps.clamp_(min=0, max=self.most_steps or None)  # a negative count, or a boast
        held = steps[steps > 0]
        if held.numel() == 0 or bool((held == held[0]).all()):
            return None
        rule = self.runner.membership.elastic.weighting
        if rule == "plain":
            return [1.0 if s > 0 else 0.0 for s in steps.tolist()]
        if rule == "normalized":
            return [1.0 / s if s > 0 else 0.0 for s in steps.tolist()]
        return [float(s) for s in steps.tolist()]

    def exchange_buffers(self, flat: torch.Tensor | None, bt: Transport) -> torch.Tensor | None:
        """Floating buffers averaged in FP32 (``average``) or rank 0's (``broadcast``)."""
        if flat is None or flat.numel() == 0:
            return None
        if self.buffers == "broadcast":
            return bt.broadcast(flat, src=0, control=False)
        return bt.all_reduce(flat).div_(bt.world_size)
