"""Check before apply (``update_bound=``): a fragment's combined update must be finite and no
larger than ``update_bound`` times the median norm of the last updates it applied, else every
site skips that outer step alike.

Every site holds the same combined update bit for bit and the same history (a shared state
part: a joiner is handed it, a checkpoint keeps it), so all decide the same without a word
exchanged. A robust combine rule bounds what a minority of sites can do; this catches what gets
through a plain mean (a finite x1000 contribution, a NaN flagged valid) at the cost of that
sync's step.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import torch

from .state import RunState, StatePart

log = logging.getLogger("lowcomm")

WINDOW = 16  # the updates the bound is learnt from (the last ones applied, per fragment)
WARMUP = 3  # updates applied before the norm bound holds (a non-finite one is always skipped)


class UpdateCheck:
    """Whether a fragment's combined update may be applied; off with ``bound`` 0."""

    def __init__(self, bound: float, state: RunState) -> None:
        self.bound = bound
        self.norms: dict[int, list[float]] = {}  # fragment -> norms of its last updates applied
        self.skipped = 0  # outer steps skipped on every site
        if bound > 0:  # (a run without the check keeps the state it always had)
            state.register("update_check", StatePart(self.save, self.load, shared=True))

    def accept(self, p: int, update: torch.Tensor, step: int) -> bool:
        """Whether fragment ``p``'s combined ``update`` at ``step`` passes (it then joins the
        history); a skip is logged, the same on every site."""
        if self.bound <= 0:
            return True
        norm = float(update.norm())
        past = self.norms.setdefault(p, [])
        limit = self.bound * statistics.median(past) if len(past) >= WARMUP else math.inf
        if math.isfinite(norm) and norm <= limit:
            past.append(norm)
            del past[:-WINDOW]
            return True
        self.skipped += 1
        why = (
            "not finite"
            if not math.isfinite(norm)
            else (f"above {self.bound:g}x the median of its last {len(past)} ({limit:.4g})")
        )
        log.warning(
            "step %d: fragment %d's combined update has norm %.4g, %s: its outer step "
            "is skipped on every site",
            step,
            p,
            norm,
            why,
        )
        return False

    def save(self) -> dict:
        return {"norms": {str(p): list(v) for p, v in self.norms.items()}, "skipped": self.skipped}

    def load(self, saved: dict | None) -> None:
        saved = saved or {}
        self.norms = {int(p): [float(x) for x in v] for p, v in saved.get("norms", {}).items()}
        self.skipped = int(saved.get("skipped", 0))


OFFENDER_RATIO = 4.0  # a contribution above this many times the sync's median norm offends


class Offenders:
    """Sites whose contribution offends (not finite, left out of most of it by the combine
    rule, or above ``OFFENDER_RATIO`` times the median norm of the sync's contributions) in
    ``syncs`` syncs in a row among the same sites (fragment syncs, for Streaming DiLoCo): each
    is named once per streak (a warning, ``stats.extra["offenders"]``) and, with ``evict``,
    excluded from an elastic run.

    Every site sees the same contributions of a sync that stood (the gather exchange) and
    computes their norms alike, so all count alike; the counts start again whenever the sites
    change and when this site missed a sync (quorum rounds: it sat out one the others
    counted), and a joiner, healed, starts with none while the others start again."""

    def __init__(self, syncs: int, evict: bool, stats: Any, runner: Any = None) -> None:
        self.syncs, self.evict, self.stats, self.runner = syncs, evict, stats, runner
        self.counts: dict[int, int] = {}
        self._among: tuple[tuple[int, ...], int] = ((), 0)

    def observe(self, reduced: Any, step: int) -> list[int]:
        """After a fragment's sync at ``step`` (``reduced.norms``: each sender's squared norm,
        by site): the sites named by it (their streak reached ``syncs`` now)."""
        if self.syncs <= 0 or reduced.norms is None or len(reduced.norms) < 3:
            return []  # (two sites cannot tell which of them stands out)
        norms = {site: math.sqrt(v) for site, v in reduced.norms.items()}
        rounds = getattr(self.runner, "rounds", None)
        among = (tuple(sorted(norms)), rounds.late_syncs if rounds is not None else 0)
        if among != self._among:
            self.counts, self._among = {}, among
        finite = [v for v in norms.values() if math.isfinite(v)]
        median = statistics.median(finite) if finite else 0.0
        named = []
        for site, norm in sorted(norms.items()):
            offends = not math.isfinite(norm) or norm > OFFENDER_RATIO * median
            self.counts[site] = self.counts.get(site, 0) + 1 if offends else 0
            if self.counts[site] == self.syncs:
                named.append(site)
        for site in named:
            self._name(site, step)
        return named

    def _name(self, site: int, step: int) -> None:
        why = (
            f"its contribution was left out by the combine rule (not finite, unreadable, "
            f"empty or against the others) or above {OFFENDER_RATIO:g}x the median norm in "
            f"{self.syncs} syncs in a row"
        )
        seen = self.stats.extra.setdefault("offenders", {})
        seen[str(site)] = seen.get(str(site), 0) + 1
        evicting = self.evict and self.runner is not None and self.runner.settled is not None
        log.warning(
            "step %d: site %d is named: %s%s",
            step,
            site,
            why,
            "; it is excluded (evict=true)" if evicting else "",
        )
        if evicting:
            tag, view = self.runner.settled
            self.runner.membership.exclude({site: why}, tag, view)
