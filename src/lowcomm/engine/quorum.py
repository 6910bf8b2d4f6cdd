"""The engine's side of quorum rounds (``Elastic(rounds="quorum")``, :mod:`lowcomm.elastic.rounds`):
a round cut short when a quorum of sites reached its sync first, and a site's arrival at a sync
(late for it, or back from one it missed)."""

from __future__ import annotations

import time
from typing import Any

from .join import rejoin


def cut_short(engine: Any, rounds: Any) -> None:
    """Once a quorum of sites has reached the next sync, ``engine`` goes there now, its
    remaining inner steps skipped (its step jumps: the training loop follows it); results due
    at the skipped steps are applied on the way, as they would have been."""
    target = engine.schedule.next_send(engine.step)
    if not rounds.closing(target, target - engine.step):
        return
    rounds.cut_rounds += 1
    rounds.cut_steps += target - engine.step
    while engine.step < target:
        engine.step += 1
        engine.run_due(engine.step)
    engine.stats.inner_steps = engine.step
    rounds.synced()


def in_round(engine: Any, step: int) -> bool:
    """At the sync of ``step`` (always True in lock-step): arrive and wait for it to close,
    the wait counted as blocked on the network; False when this site is late for it. A site
    that missed one heals at this one first (:func:`.join.rejoin`)."""
    rounds = getattr(engine.membership, "rounds", None)
    if rounds is None:
        return True
    t0 = time.perf_counter()
    try:
        if not rounds.arrive(step):
            return False
        if rounds.stale and not rejoin(engine, f"sync@{step}", carry=rounds.late == "carry"):
            rounds.late_syncs += 1
            return False
        return True
    finally:
        engine.transport.meter.add_blocked(time.perf_counter() - t0)  # waited for the others
