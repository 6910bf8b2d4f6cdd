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
        why = "not finite" if not math.isfinite(norm) else (
            f"above {self.bound:g}x the median of its last {len(past)} ({limit:.4g})")  # fmt: skip
        log.warning("step %d: fragment %d's combined update has norm %.4g, %s: its outer step "
                    "is skipped on every site", step, p, norm, why)  # fmt: skip
        return False

    def save(self) -> dict:
        return {"norms": {str(p): list(v) for p, v in self.norms.items()},
                "skipped": self.skipped}  # fmt: skip

    def load(self, saved: dict | None) -> None:
        saved = saved or {}
        self.norms = {int(p): [float(x) for x in v] for p, v in saved.get("norms", {}).items()}
        self.skipped = int(saved.get("skipped", 0))
