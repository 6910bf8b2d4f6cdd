"""The engine's side of quorum rounds (``Elastic(rounds="quorum")``, :mod:`lowcomm.elastic.rounds`):
a round cut short when a quorum of sites reached its sync first, and a site's arrival at a sync
(late for it, or back from one it missed). The engine's step stays the engine's: these read it
and hand back what to do, through the callables the engine passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..elastic.rounds import Rounds
    from ..schedule import Schedule
    from ..transport import ByteMeter


def cut_short(rounds: Rounds, schedule: Schedule, step: int, go_to: Callable[[int], None]) -> None:
    """Once a quorum of sites has reached the next sync after ``step``, the engine goes there
    now (``go_to``: its step jumps, results due at the skipped steps applied on the way, as
    they would have been; the training loop follows it), its remaining inner steps skipped."""
    target = schedule.next_send(step)
    if not rounds.closing(target, target - step):
        return
    rounds.cut(target - step)
    go_to(target)
    rounds.synced()


def in_round(
    rounds: Rounds | None, step: int, meter: ByteMeter, rejoin: Callable[[str, bool], bool]
) -> bool:
    """At the sync of ``step`` (always True in lock-step, ``rounds`` None): arrive and wait for
    it to close, the wait counted as blocked on ``meter``; False when this site is late for it.
    A site that missed one heals at this one first (``rejoin(tag, carry)``:
    :func:`.join.rejoin`)."""
    if rounds is None:
        return True
    t0 = time.perf_counter()
    try:
        if not rounds.arrive(step):
            return False
        if rounds.stale and not rejoin(f"sync@{step}", rounds.late == "carry"):
            rounds.missed()
            return False
        return True
    finally:
        meter.add_blocked(time.perf_counter() - t0)  # waited for the others
