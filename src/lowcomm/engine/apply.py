"""Applying results: the outer step on a fragment's global copy, then its merge rule into the
local weights (or a restart, for a worker whose own update was non-finite), shared with the
worker's other ranks, and the averaged buffers loaded."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import _buffers
from ..aggregate import Reduced
from ..outer import OuterOptimizer
from .check import Offenders, UpdateCheck
from .exchange import Event
from .fragment import Fragment
from .guards import NonFiniteGuard, restart
from .inflight import InFlight, Result
from .merge import Merge
from .placement import Placement
from .stats import SyncTimes


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
        if reduced.unapplied is None or not hasattr(self.compensation, "restore"):
            return
        names = [frag.names[i] for bucket in frag.buckets for i in bucket]
        for name, part in zip(names, reduced.unapplied, strict=True):
            self.compensation.restore(name, part)

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
            self.guard.track(p, event, workers, step)
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
