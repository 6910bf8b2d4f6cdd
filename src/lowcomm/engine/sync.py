"""One sync, top to bottom: what ``LowComm.run_due`` calls once the schedule says a fragment
is due.

1. :func:`send`: each fragment due is encoded by the :class:`Encoder` (its pseudo-gradient into
   persistent slabs, the contribution hooks, error compensation, the aggregator's codec per
   bucket), then the :class:`Exchange` builds the sync's collectives as one job: every worker's
   control flags, each fragment through the aggregator, the floating buffers. Without overlap
   the job runs now; with overlap it goes to the transport's comm thread and waits in the
   :class:`InFlight` table until its result falls due.
2. :class:`Apply`: each result due gets the outer step on its fragment's global copy, then the
   merge rule (:class:`Replace`, :class:`AlphaMix` or :class:`Continue`) takes it into the
   local weights, shared with the worker's other ranks.

The aggregator (``lowcomm.aggregate``) holds the codec and the combine rule; the outer
optimizer (``lowcomm.outer``) the outer step; a fragment (``fragment``) its global copy and
pseudo-gradient. With membership, the exchange's collectives run on the live quorum through
the elastic runner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.nn as nn

from .. import _buffers
from ..aggregate import Aggregator, Encoded, Reduced, encode_compensated
from ..aggregate.base import Valid
from ..config import SyncConfig
from ..errors import SiteLeft
from ..outer import OuterOptimizer
from ..protocols import Contribution, SyncHooks
from ..schedule import Schedule
from ..transport import Transport
from .check import Offenders, UpdateCheck
from .fragment import Fragment
from .guards import NonFiniteGuard, ReplicaCheck, restart
from .placement import Placement
from .state import RunState, StatePart
from .stats import SyncStats, SyncTimes
from .tensors import Slabs, copy_into, elsewhere, on_device_of, views

if TYPE_CHECKING:
    from ..elastic import Runner

T = TypeVar("T")

# Columns of the per-exchange control flags (one int64 row per worker): then P unsent counts
# from UNSENT on, then P validity flags (see flags_row).
DONE, STEP, NONFINITE, UNSENT = 0, 1, 2, 3

#: a result taken from the table: (average, own send decoded, its event)
Result = tuple["Reduced", "torch.Tensor | None", "Event"]


class Parts(Protocol):
    """What a sync reads of the engine's parts (:class:`.wiring.Parts` has them all)."""

    @property
    def fragments(self) -> list[Fragment]: ...
    @property
    def encoder(self) -> Encoder: ...
    @property
    def exchange(self) -> Exchange: ...
    @property
    def inflight(self) -> InFlight: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def membership(self) -> Runner | None: ...
    @property
    def replica(self) -> ReplicaCheck: ...


# -- 1. send -----------------------------------------------------------------------------------


def send(
    parts: Parts,
    schedule: Schedule,
    times: SyncTimes,
    state: RunState,
    sends: list[int],
    step: int,
    flags: torch.Tensor | None,
    results: dict[int, Result],
) -> None:
    """Encode fragments ``sends`` after inner step ``step`` and exchange them; ``flags``: the
    control flags already gathered (a worker that has left); a blocking exchange's results go
    into ``results``."""
    frags = parts.fragments
    encoded: dict[int, Encoded] = {}
    owns: dict[int, torch.Tensor | None] = {}
    nonfinite = False
    # quorum rounds weight each contribution by the steps it holds (encoding resets them)
    covered = {p: frags[p].unsent for p in sends} if parts.exchange.weighted else None
    sent: dict[int, int] = {}  # valid (1) or not (0); -1: the device's flag rides the payload
    with times.stage("encode"):
        for p in sends:
            had = frags[p].unsent > 0
            encoded[p], owns[p], bad = parts.encoder.encode(frags[p], step)
            nonfinite |= bad
            sent[p] = -1 if encoded[p].ok is not None else int(had and not bad)
    mine = None
    if flags is None:
        mine = parts.exchange.flags(step, False, nonfinite, covered, sent)
    tag = f"sync@{step}"
    job = parts.exchange.job(encoded, mine, flags, tag)
    healing = offer_heal(parts.membership, state, schedule, tag, step, results)
    if schedule.overlap == 0:
        event = parts.transport.blocking(job)
        results.update({p: (event.reduced[p], owns[p], event) for p in sends})
    else:
        parts.inflight.submit(job, step, schedule.apply_step(step), owns)
        if healing:  # the heal reads the state on the comm thread: it must hold still
            parts.transport.wait(parts.inflight.pending[sends[0]].future)


def counted(
    parts: Parts,
    stats: SyncStats,
    schedule: Schedule,
    check_every: int,
    n_fragments: int,
    step: int,
) -> None:
    """A sync of ``n_fragments`` done at ``step``: counted, and every ``check_every`` syncs of
    the run (0: never) the replica check started on it."""
    stats.syncs += 1
    stats.fragment_syncs += n_fragments
    if check_every and schedule.syncs_through(step) % check_every == 0:  # the run's count
        parts.replica.start(parts.fragments, f"check@{step}")


def offer_heal(
    runner: Runner | None,
    state: RunState,
    schedule: Schedule,
    tag: str,
    step: int,
    results: dict[int, Result],
) -> bool:
    """Let a site join at sync ``tag``: its quorum may admit a joiner only if every member
    offers the run's shared state as of now (results due at this step taken, not yet applied:
    nothing else is in flight at a send, by the overlap rule). With overlap the sync then
    blocks, so the offer is made only while a site is waiting to join."""
    if runner is None or not (schedule.overlap == 0 or runner.joiner_expected(tag)):
        return False

    def shared() -> dict[str, Any]:
        # this sync's own exchange is in the table by then: the results in hand instead
        held = state.shared_state_dict(skip=("pending",))
        held["pending"] = in_hand(results, step - schedule.overlap, step)
        return held

    runner.offer(tag, shared)
    return True


# -- the encoder -------------------------------------------------------------------------------
class Encoder:
    """Turns fragments into payloads (a non-finite one is reported to the guard).

    Each fragment's pseudo-gradient is written into persistent slabs (no model-sized temporary
    per sync); with ``in_flight=2`` (CO2: a round's average lands only at the next send, after
    that send was encoded) two sets alternate.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        compensation: Any,
        guard: NonFiniteGuard,
        rank: int,
        hooks: SyncHooks,
        in_flight: int = 1,
    ) -> None:
        self.aggregator, self.compensation = aggregator, compensation
        self.guard, self.rank, self.hooks = guard, rank, hooks
        self.in_flight = in_flight
        self._slabs: dict[int, list[Slabs]] = {}
        self._sends: dict[int, int] = {}
        self._defers: dict[int, bool] = {}

    def slabs(self, frag: Fragment) -> Slabs:
        """The slabs this send of ``frag`` writes (allocated at its first sends)."""
        sets = self._slabs.setdefault(frag.index, [])
        n = self._sends.get(frag.index, 0)
        self._sends[frag.index] = n + 1
        if len(sets) <= n % self.in_flight:
            sets.append(Slabs(frag.params, frag.global_flat.device))
        return sets[n % self.in_flight]

    def count_step(self, transport: Transport) -> None:
        """Count one inner optimizer step for the error buffers' periodic resets (the
        two-phase reduce's own on the comm thread, after the exchanges queued before it)."""
        if self.compensation is not None:
            self.compensation.step()
        if self.aggregator.reduce_compensation is not None:
            transport.submit(self.aggregator.step)

    def encode(
        self, frag: Fragment, step: int, defer: bool = True
    ) -> tuple[Encoded, torch.Tensor | None, bool]:
        """One fragment's pseudo-gradient, compensated and encoded (the whole fragment at
        once: its buckets are only the collectives').

        Returns the payload, what this worker sent decoded (for the continue merge) and
        whether its update was found non-finite here. A fragment without inner steps since its
        last send (a worker that has left its loop) is not contributed; a non-finite one is
        left out: peers average without it and its error buffer is not polluted. Where the
        aggregator takes a device flag and the run defers its checks, the finite check is not
        read here: the payload carries it, and the exchange's result tells (``left_out_here``);
        ``defer=False`` reads it here all the same (the exit's last exchange, applied apart).
        Compensation, when there is one: error feedback, e <- beta e + delta, send e,
        e <- e - sent; LoCo, h = delta + e, e <- moving average of h - sent.
        """
        slabs = self.slabs(frag)
        need_own = frag.snapshot is not None  # continue merge: keep what is sent, and the weights
        finite = frag.pseudo_grad_into(slabs.views, take_snapshot=need_own)
        contributes = frag.unsent > 0
        valid, nonfinite = self._valid(finite, contributes, defer)
        if nonfinite:
            self.guard.leave_out(frag, step)
        compensation = self.compensation
        sends = contributes and not nonfinite
        if sends:  # contribution hooks act here: past the site's own checks, before encoding
            c = self.hooks.contribution(Contribution(step, slabs.views, frag.global_views))
            if not c.compensate:
                compensation = None
        shapes = [v.shape for v in slabs.views]
        counts = [len(b) for b in frag.buckets]
        # (the name of the reduce-side buffer from when each bucket had its own: checkpoints
        # hold it)
        key = f"fragment {frag.index} bucket 0"
        if compensation is None:
            want = "dense" if need_own else ""
            enc = self.aggregator.encode(slabs.values, shapes, counts, valid, want, key, slabs.flat)
        else:
            enc = encode_compensated(
                self.aggregator, compensation, frag.names, slabs.values, shapes, counts, valid,
                key, need_dense=need_own,
            )  # fmt: skip
        own = None
        if need_own:
            own = slabs.own()
            if sends:  # a copy: own never aliases a payload (unread if left out after all)
                assert enc.local is not None
                own.copy_(enc.local)
            else:
                own.zero_()
            enc.local = None  # kept in own: the exchange may now reduce the payload in place
        if enc.payload is not slabs.flat:  # the slab is free again: the mean may land there
            enc.out = slabs.values
        frag.unsent = 0
        return enc, own, nonfinite

    def _valid(self, finite: torch.Tensor, contributes: bool, defer: bool) -> tuple[Valid, bool]:
        """Whether a fragment's update goes out valid (``finite`` itself, a 0-d bool on the
        device, where the aggregator takes one and the run defers its checks: nothing read),
        and whether it was found non-finite here."""
        agg = self.aggregator
        if contributes and defer and agg.deferred_checks and agg.takes_device_flag:
            return finite, False
        nonfinite = contributes and not bool(finite)
        return contributes and not nonfinite, nonfinite


# -- the exchange ------------------------------------------------------------------------------
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
        encoded: dict[int, Encoded],
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
        encoded: dict[int, Encoded],
        mine: torch.Tensor | None,
        flags: torch.Tensor | None,
        buffers: torch.Tensor | None,
    ) -> Event:
        aggregator, times = self.aggregator, self.times
        t0, collective0, exchanging = time.perf_counter(), aggregator.collective_s, 0.0
        gathered = flags if mine is None else torch.stack(transport.all_gather(mine, control=True))
        sent0 = transport.meter.sent_bytes
        reduced = {}
        for p, enc in encoded.items():
            if self.runner is not None:  # an attempt may fail half-way: keep the bytes intact
                enc = dataclasses.replace(enc, payload=enc.payload.clone())
            t1 = time.perf_counter()
            w = self.weights(gathered, p) if self.weighted else None
            # an all-reduce need not read its count from the device
            enc.senders = senders_of(gathered, p, transport.world_size)
            reduced[p] = self._by_site(aggregator.exchange(enc, transport, w))
            exchanging += time.perf_counter() - t1
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


# -- results in flight -------------------------------------------------------------------------
@dataclass
class Pending:
    """One fragment's exchange in flight."""

    future: Future  # of an Event
    sent_at: int
    apply_at: int
    own: torch.Tensor | None = None  # continue merge: what this worker sent, decoded


class InFlight:
    """The pending table: submit an exchange, find what is due, take or drain results."""

    def __init__(self, transport: Transport, state: RunState) -> None:
        self.transport = transport
        self.pending: dict[int, Pending] = {}
        # shared: the averages in flight are the same on every site (each one's own send
        # is not, and a joiner has none: see ``shared``)
        # a fresh worker of a world of another size: those results are dropped
        state.register(
            "pending",
            StatePart(self.save, self.load, shared=True, share=self.shared, fresh={}, buffer=True),
        )

    def due(self, step: int, sends: list[int]) -> list[int]:
        """Fragments whose result must be applied now: due at ``step``, or sent again now.

        An exchange that ended this site's part in the run on the comm thread (a replayed
        leave: SiteLeft) is raised here, at the next step, not when its result falls due."""
        for pend in self.pending.values():
            if pend.future.done() and isinstance(pend.future.exception(), SiteLeft):
                raise pend.future.exception()  # type: ignore[misc]
        return sorted(p for p, pend in self.pending.items() if pend.apply_at <= step or p in sends)

    def submit(
        self,
        job: Callable[[], Event],
        step: int,
        apply_at: int,
        owns: dict[int, torch.Tensor | None],
    ) -> None:
        """Start ``job`` on the comm thread; its fragments are applied after ``apply_at``."""
        future = self.transport.submit(job)
        for p, own in owns.items():
            self.pending[p] = Pending(future, step, apply_at, own)

    def own(self, p: int) -> torch.Tensor | None:
        """What this worker sent of fragment ``p`` and has not had back yet (decoded)."""
        pend = self.pending.get(p)
        return pend.own if pend is not None else None

    def take(self, p: int) -> Result:
        """Wait for fragment ``p``'s result and remove it from the table."""
        pend = self.pending.pop(p)
        event = self.transport.wait(pend.future)
        return event.reduced[p], pend.own, event

    def save(self) -> dict[str, Any]:
        """Every result in flight, awaited (not applied early) and stored as tensors."""
        out = {}
        for p in sorted(self.pending):
            pend = self.pending[p]
            event = self.transport.wait(pend.future)
            done: Future = Future()
            done.set_result(event)
            self.pending[p] = dataclasses.replace(pend, future=done)
            # copies: the mean and own send live in buffers the next sends reuse
            own = pend.own.clone() if pend.own is not None else None
            out[str(p)] = {**_entry(p, event, pend.sent_at, pend.apply_at), "own": own}
        return out

    def shared(self) -> dict[str, Any]:
        """The results in flight as every site holds them: without this site's own send (nor
        whether it was left out)."""
        mine = ("own", "left_out")
        return {p: {k: v for k, v in d.items() if k not in mine} for p, d in self.save().items()}

    def load(self, saved: dict[str, Any]) -> None:
        """Replace the table with the results of :meth:`save`."""
        self.pending = {int(p): _pending_from(int(p), d) for p, d in saved.items()}


def _pending_from(p: int, d: dict[str, Any]) -> Pending:
    fut: Future = Future()
    flags = d.get("flags")
    if flags is None:  # checkpoints written before the control flags existed
        flags = torch.zeros((1, UNSENT), dtype=torch.int64)
    told = {"nonfinite": tuple(d.get("nonfinite", ())), "left_out_here": bool(d.get("left_out", 0))}
    reduced = Reduced(d["mean"], int(d["valid_workers"]), **told)
    fut.set_result(Event(flags, {p: reduced}, d.get("buffers")))
    return Pending(fut, int(d["sent_at"]), int(d["apply_at"]), d.get("own"))


def in_hand(results: dict[int, Result], sent_at: int, apply_at: int) -> dict[str, Any]:
    """Results taken from the table and not applied yet, as :meth:`InFlight.shared` gives them
    (a heal at a sync hands over what the sites apply right after sending it)."""
    return {str(p): _entry(p, results[p][2], sent_at, apply_at) for p in sorted(results)}


def _entry(p: int, event: Event, sent_at: int, apply_at: int) -> dict[str, Any]:
    red = event.reduced[p]
    # what the payloads told (a check left on the device), kept only where they told anything
    told: dict[str, Any] = {}
    if red.nonfinite or red.left_out_here:
        told = {"nonfinite": list(red.nonfinite), "left_out": int(red.left_out_here)}
    return {
        "mean": red.mean.clone(),
        "valid_workers": red.valid_workers,
        "flags": event.flags.clone(),
        "buffers": event.buffers,
        "sent_at": sent_at,
        "apply_at": apply_at,
        **told,
    }


# -- 2. apply ----------------------------------------------------------------------------------
class Apply:
    """Outer step and merge for each result, with the parts they need."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        frags: list[Fragment],
        outer: OuterOptimizer,
        merge: Merge,
        *,
        merge_at_first_send: bool,
        inflight: InFlight,
        guard: NonFiniteGuard,
        placement: Placement,
        times: SyncTimes,
        compensation: Any = None,
        check: UpdateCheck | None = None,
        offenders: Offenders | None = None,
    ) -> None:
        self.model, self.inner_optimizer, self.frags = model, inner_optimizer, frags
        self.outer, self.merge, self.inflight = outer, merge, inflight
        # CO2's round 0 has no stale average to apply (theta_1 = theta_0), but its merge
        # rule runs all the same on what it just sent
        self.merge_at_first_send = merge_at_first_send
        self.guard, self.placement, self.times = guard, placement, times
        self.compensation = compensation
        self.check = check  # check before apply (update_bound=): None or off, every update
        self.offenders = offenders  # sites whose contributions stand out, sync after sync

    def results(
        self, sends: list[int], results: dict[int, Result], workers: int, step: int
    ) -> None:
        """Apply each result due (fragment order), then the first-send merges."""
        with torch.no_grad():
            for p in sorted(results):
                self.one(p, *results[p], workers=workers, step=step)
            if self.merge_at_first_send:
                first = [self.frags[p] for p in sends if p not in results]
                for frag in first:
                    self.merge.merge(frag, self.inflight.own(frag.index))
                self.placement.share_parts(first)

    def _passes(self, p: int, reduced: Reduced, step: int) -> bool:
        return self.check is None or self.check.accept(p, reduced.mean, step)

    def restore_unapplied(self, frag: Fragment, reduced: Reduced) -> None:
        """A weighted exchange applied only part of this worker's message: the rest goes back
        into its error buffers (error feedback had counted all of it as sent). Here, once the
        sync committed: an attempt that failed and was retried restores nothing."""
        if reduced.unapplied is None or not getattr(self.compensation, "restores", False):
            return
        shapes = [v.shape for v in frag.global_views]
        self.compensation.restore_flat(frag.names, shapes, reduced.unapplied)

    def one(
        self,
        p: int,
        reduced: Reduced,
        own: torch.Tensor | None,
        event: Event,
        workers: int = 0,
        step: int = 0,
        final: bool = False,
    ) -> None:
        """Outer step on fragment p's global copy, then merge it into the local parameters.

        ``final`` (leaving the block): no non-finite bookkeeping, buffers left to the exit.
        """
        frag = self.frags[p]
        if reduced.left_out_here:  # its update was not finite, told with the result (the
            # check stayed on the device): left out as if found at the send (counted, and
            # restarted below unless this is the exit's drain, as then)
            self.guard.leave_out(frag, step)
        if not final:
            self.guard.track(p, event.nonfinite_workers, workers, step)
            if self.offenders is not None:
                self.offenders.observe(reduced, step)
        self.restore_unapplied(frag, reduced)
        with self.times.stage("outer"):
            if reduced.valid_workers > 0 and self._passes(p, reduced, step):
                self.outer.step(
                    frag.key, frag.global_flat, reduced.mean.to(frag.global_flat.device)
                )
        with self.times.stage("merge"):
            if p in self.guard.left_out and not final:
                self.guard.left_out.discard(p)
                restart(frag, self.inner_optimizer)
            else:
                self.merge.merge(frag, self.inflight.own(p))
            self.placement.share_parts([frag])
            if event.buffers is not None and not final:
                _buffers.load_float_flat(self.model, event.buffers)


# -- the merge rules ---------------------------------------------------------------------------
class Merge:
    """A merge rule; ``needs_snapshot`` when fragments must remember their last send.

    Replace and the alpha-mix consume the inner steps taken while a result was in flight (they
    are discarded, or mixed into the local weights): a fragment's steps count as unsent only
    after its last result landed. Continue keeps them, to be sent with the next send.
    """

    needs_snapshot = False

    def merge(self, frag: Fragment, in_flight: torch.Tensor | None) -> None:
        """Merge ``frag``'s global copy into its local weights; ``in_flight`` is what this
        worker sent and has not had back yet (decoded), if anything."""
        raise NotImplementedError


class Replace(Merge):
    """The local weights become the global copy."""

    def merge(self, frag: Fragment, in_flight: torch.Tensor | None) -> None:
        frag.load_global()


class AlphaMix(Merge):
    """``theta <- alpha * theta + (1 - alpha) * global`` (Streaming DiLoCo's merge)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def merge(self, frag: Fragment, in_flight: torch.Tensor | None) -> None:
        # multi-tensor kernels: launches that do not grow with the number of parameters (host
        # state of an accelerator's model: in one transfer)
        params = [p.detach() for p in frag.params]
        glob = on_device_of(params, frag.global_flat)
        torch._foreach_mul_(params, self.alpha)
        torch._foreach_add_(params, views(glob, params), alpha=1.0 - self.alpha)


class Continue(Merge):
    """theta <- global - kappa * (own send in flight) - (progress since the last send).

    The invariant: a worker's weights are the global copy minus its own progress that the
    global copy does not hold yet (the part of its send in flight it keeps: kappa, CO2's
    co2_keep, else 1). CO2 (tau = H): right after round r is sent this is
    theta_{r+1} - kappa * delta_r; a drain at the end gives theta - (the partial round).
    """

    needs_snapshot = True

    def __init__(self, keep: float) -> None:
        self.keep = keep

    def merge(self, frag: Fragment, in_flight: torch.Tensor | None) -> None:
        assert frag.snapshot is not None
        if elsewhere(frag.params, frag.global_flat.device):
            self._merge_on_the_accelerator(frag, in_flight)
        else:
            self._merge_at_once(frag, in_flight)

    def _merge_at_once(
        self,
        frag: Fragment,
        in_flight: torch.Tensor | None,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The merge as multi-tensor kernels over every parameter (launches that do not grow
        with the number of parameters). ``state``: (global copy, snapshot) where the work is
        done, if not the fragment's own."""
        assert frag.snapshot is not None
        glob_flat, snap_flat = state or (frag.global_flat, frag.snapshot)
        params = [p.detach() for p in frag.params]
        # the snapshot holds the progress since the last send, then the new snapshot: one
        # temporary the model's size (new_local), not three (each a fresh allocation)
        progress = views(snap_flat, params)
        torch._foreach_sub_(progress, params)  # FP32 whatever the parameters' dtype
        glob = views(glob_flat, params)
        if in_flight is not None:
            own = views(in_flight.to(glob_flat.device), params)
            new_local = torch._foreach_sub(glob, own, alpha=self.keep)
            torch._foreach_sub_(new_local, progress)
        else:
            new_local = torch._foreach_sub(glob, progress)
        copy_into(params, new_local)
        torch._foreach_add_(progress, new_local)  # progress + new_local: the next snapshot

    def _merge_on_the_accelerator(self, frag: Fragment, in_flight: torch.Tensor | None) -> None:
        """Host state of an accelerator's model: the global copy, the snapshot and what is in
        flight each go over in one transfer, the merge runs there, the snapshot comes back
        in one."""
        assert frag.snapshot is not None
        params = frag.params
        snap = on_device_of(params, frag.snapshot)
        own = on_device_of(params, in_flight) if in_flight is not None else None
        self._merge_at_once(frag, own, (on_device_of(params, frag.global_flat), snap))
        frag.snapshot.copy_(snap)


def make_merge(cfg: SyncConfig, schedule: Schedule) -> Merge:
    """The merge rule of a config: CO2's whole-round overlap continues by ``co2_merge``
    (keeping ``co2_keep`` of its own round in flight), other overlaps by ``merge``; otherwise
    the alpha-mix (replace at alpha 0, and always without overlap)."""
    if schedule.is_round_overlap():
        if cfg.co2_merge == "continue":
            return Continue(cfg.co2_keep)
    elif schedule.overlap > 0 and cfg.merge == "continue":
        return Continue(1.0)
    alpha = cfg.alpha if schedule.overlap > 0 else 0.0
    return Replace() if alpha == 0.0 else AlphaMix(alpha)
