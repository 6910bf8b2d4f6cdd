"""One sync as attempts: what an attempt came to (:class:`Outcome`), what its commit vote said
(:class:`Verdict`), and the retry policy a run chooses once (:func:`policy_for`): when the same
failure is taken as real, and what the next attempt after a failed one asks the lighthouse."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .decide import View
from .membership import Retry

SAME_FAILURES = 3  # attempts among unchanged members before an error is taken as real
# ... where a vote missed a member's (it decided nothing): no evidence the error is real, but
# still a bound (each attempt waits at most its deadline and the vote's)
UNSURE_FAILURES = 10


@dataclass(frozen=True)
class Outcome:
    """One attempt on ``view``'s group: its ``result`` when this site's collectives completed
    (``error`` None), else the error's first line and what this site names in its vote: the
    sender of a payload that failed to decode (``blame``: site, why) and the members it never
    reached. (Not the error itself: its traceback holds the failed group, which must close.)"""

    view: View
    result: Any = None
    error: str | None = None
    blame: tuple[int, str] | None = None
    unreached: list[int] | None = None
    deadline_s: float = 0.0  # the bound its collectives ran under

    @property
    def ok(self) -> bool:
        """Whether this site completed the attempt's collectives."""
        return self.error is None


@dataclass(frozen=True)
class Verdict:
    """The commit vote on an attempt, read alike by every member: whether the sync stands,
    else who every member excludes (site -> why), the vote itself, and the members whose vote
    alone failed it (see :func:`.decide.dissenters`)."""

    stands: bool
    commit: View
    out: dict[int, str]
    dissent: tuple[int, ...] = ()
    complete: bool = True  # every member's vote was read (else it decided nothing)


#: why a member whose lone vote failed attempt after attempt is excluded
LONE_DISSENT = (
    f"its vote alone failed {SAME_FAILURES} attempts in a row (it said the sync failed, or "
    f"accused a site nobody else did, while the others completed it)"
)


class LockStep:
    """Retries of one sync under lock-step rounds: the lighthouse waits for every live site, so
    the next attempt simply asks again. The same members failing ``SAME_FAILURES`` times with
    nobody excluded is taken as real (this site's error is raised, and it stops)."""

    def __init__(self) -> None:
        self._stuck: list[list[int]] = []  # the members of each failed attempt that excluded nobody
        self._unsure = 0  # failed attempts whose vote missed a member's
        self._dissent: list[tuple[list[int], set[int]]] = []  # ... and whose lone vote failed it

    def judged(self, outcome: Outcome, verdict: Verdict) -> Verdict:
        """``verdict`` with the members whose lone vote failed the last ``SAME_FAILURES``
        attempts among the same members added to those excluded (every member reads the same
        votes, so all exclude them alike; an insider voting against every sync, or accusing an
        honest site, leaves instead of looping the run)."""
        if verdict.out:
            self._dissent.clear()
            return verdict
        self._dissent.append((outcome.view.members, set(verdict.dissent)))
        recent = self._dissent[-SAME_FAILURES:]
        if len(recent) < SAME_FAILURES or any(m != outcome.view.members for m, _ in recent):
            return verdict
        lone = set.intersection(*(d for _, d in recent))
        return dataclasses.replace(verdict, out={s: LONE_DISSENT for s in sorted(lone)})

    def hopeless(self, view: View) -> bool:
        """Whether an attempt of ``view``'s members that just failed here is one too many:
        after ``SAME_FAILURES - 1`` complete votes among them excluded nobody, or
        ``UNSURE_FAILURES`` votes missed a member's."""
        same = self._stuck[-(SAME_FAILURES - 1) :].count(view.members) == SAME_FAILURES - 1
        return same or bool(self.exhausted())

    def exhausted(self) -> str:
        """Why no further attempt is made where this site's collectives completed but the
        votes kept missing a member's ('' while attempts go on)."""
        if self._unsure < UNSURE_FAILURES:
            return ""
        return (
            f"its commit vote missed a member's in {self._unsure} attempts of this sync (at "
            f"most {UNSURE_FAILURES} such attempts a sync, each bounded by its deadline)"
        )

    def after(self, outcome: Outcome, verdict: Verdict) -> Retry | None:
        """Note a failed attempt; what the next one asks with (None: ask as the first did)."""
        if not verdict.out and verdict.complete:
            self._stuck.append(outcome.view.members)
        elif not verdict.out:  # (chaos seed 5 with a stranger: two such, and the run stopped)
            self._unsure += 1
        return None


class QuorumRounds(LockStep):
    """Retries under quorum rounds, whose lighthouse gathers only those asking within half a
    second: the next attempt waits for the failed one's live members (see Patience) and runs no
    split pair again. (Asked again under lock-step, the same members came back, and the member
    whose re-asking outlasted the others' asked alone and stopped: chaos seed 112.)"""

    def after(self, outcome: Outcome, verdict: Verdict) -> Retry | None:
        super().after(outcome, verdict)
        named = outcome.unreached or any(d.unreached for d in verdict.commit.data)
        live = {d.site: d.store for d in outcome.view.data if d.site not in verdict.out}
        return Retry(live, not verdict.out and bool(named), outcome.deadline_s)


def policy_for(rounds: str) -> Callable[[], LockStep]:
    """The retry policy of a run's ``rounds`` setting (a fresh one per sync)."""
    return QuorumRounds if rounds == "quorum" else LockStep
