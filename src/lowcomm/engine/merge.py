"""Merge rules: how a fragment's new global copy enters this worker's local weights.

One rule is chosen at construction from the config (:func:`make_merge`):

- :class:`Replace`: the local weights become the global copy (tau = 0, CO2's ``reset``);
- :class:`AlphaMix`: ``theta <- alpha * theta + (1 - alpha) * global`` (Streaming, tau >= 1);
- :class:`Continue`: ``theta <- global - kappa * (own send in flight) - (progress since it)``,
  keeping the steps taken while the result was in flight (``merge=continue``; CO2's default,
  whose kappa is ``co2_keep``).
"""

from __future__ import annotations

import torch

from ..codecs.topk_many import wanted
from ..config import SyncConfig
from ..schedule import Schedule
from .fragment import Fragment
from .tensors import copy_into, elsewhere, on_device_of, pieces, views


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
        params = [p.detach() for p in frag.params]
        dev = params[0].device if params else frag.global_flat.device
        if wanted(dev) and all(p.dtype == torch.float32 and p.device == dev for p in params):
            # an accelerator: multi-tensor kernels (launches that do not grow with the number
            # of parameters), the same element-wise ops and bits; host state in one transfer
            glob = on_device_of(params, frag.global_flat)
            torch._foreach_mul_(params, self.alpha)
            torch._foreach_add_(params, views(glob, params), alpha=1.0 - self.alpha)
            return
        for p, g in pieces(frag.params, frag.global_flat):  # one pass: p is re-read in cache
            self._mix(p, g)

    def _mix(self, p: torch.Tensor, g: torch.Tensor) -> None:
        p.mul_(self.alpha).add_(g.to(p.device, p.dtype), alpha=1.0 - self.alpha)


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
            return
        if wanted(frag.global_flat.device):
            self._merge_at_once(frag, in_flight)
            return
        # chunk by chunk, so progress and the new weights are temporaries of one chunk: one
        # read of global, own, snapshot and local, one write of local and snapshot
        flats = [frag.global_flat, frag.snapshot]
        if in_flight is not None:
            flats.append(in_flight.to(frag.global_flat.device))
        for p, g, snap, *own in pieces(frag.params, *flats):
            progress = snap - p.to(snap.device, torch.float32)
            new_local = torch.sub(g, own[0], alpha=self.keep) if own else g.clone()
            new_local.sub_(progress)
            torch.add(new_local, progress, out=snap)
            p.copy_(new_local)

    def _merge_at_once(
        self,
        frag: Fragment,
        in_flight: torch.Tensor | None,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The same steps as multi-tensor kernels over every parameter (an accelerator's
        launches then do not grow with the number of parameters); the same bits. ``state``:
        (global copy, snapshot) where the work is done, if not the fragment's own."""
        assert frag.snapshot is not None
        glob_flat, snap_flat = state or (frag.global_flat, frag.snapshot)
        params = frag.params
        dev = glob_flat.device
        local = [p.detach().to(dev, torch.float32) for p in params]
        snap = views(snap_flat, params)
        progress = torch._foreach_sub(snap, local)
        glob = views(glob_flat, params)
        if in_flight is not None:
            new_local = torch._foreach_sub(glob, views(in_flight.to(dev), params), alpha=self.keep)
        else:
            new_local = [g.clone() for g in glob]
        torch._foreach_sub_(new_local, progress)
        torch._foreach_copy_(snap, torch._foreach_add(new_local, progress))
        copy_into([p.detach() for p in params], new_local)

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
