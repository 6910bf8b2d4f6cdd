"""The send half of a sync: encode the fragments due, start (or, without overlap, run) their
exchange, and offer the run's shared state to a site waiting to join at that sync."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .inflight import Result, in_hand

if TYPE_CHECKING:
    from ..aggregate import Encoded
    from ..elastic import Runner
    from ..schedule import Schedule
    from .state import RunState
    from .stats import SyncStats, SyncTimes
    from .wiring import Parts


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
    encoded: dict[int, list[Encoded]] = {}
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
            deferred = any(e.ok is not None for e in encoded[p])
            sent[p] = -1 if deferred else int(had and not bad)
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
