"""What the robust combine rules share (``median``, ``trimmed-mean``, ``centered-clip``,
``norm-clip``, ``cosine-clip``, ``share-clip``): they defend the merge against a minority of bad
contributions, so they trust nothing a contribution says about itself.

- A part that is not finite in a tensor is left out of that tensor; a payload that does not
  decode (a NaN scale, an index out of range) is left out of the whole fragment, whatever its
  validity flag says (a site's own flag is what a bad site controls); the plain rules stop the
  run on it instead (the sender named).
- Every contribution counts once: a self-reported step weight (quorum rounds) would let a site
  buy influence by reporting more steps, so these rules take no weights, and what a weight
  left out of a part (:meth:`~lowcomm.aggregate.combine.Combine.unapplied`) is nothing.
- Each runs on the gather exchange, which hands every receiver every contribution in the same
  order; sums run in that order, so every receiver computes the same bits.
- Each decides per tensor, over the whole fragment at once: a part's norm, the median of the
  norms and what is left out are per (part, tensor), as segments of the flat values
  (:class:`~lowcomm.segments.Segments`), with no read of the device.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ...segments import Segments
from ..combine import Combine, Contributions


class Robust(Combine):
    """A rule over the finite contributions of each tensor, each counted once."""

    dense_only = True  # a coordinate's median or trim needs every site's value there
    robust = True
    _left: torch.Tensor | None = None

    def combine(self, parts: Contributions, out: torch.Tensor) -> torch.Tensor:
        rows, usable = usable_rows(parts)
        self._left = ~usable
        return out.copy_(self.robust_rows(rows, usable, parts.segments))

    @abstractmethod
    def robust_rows(self, rows: torch.Tensor, usable: torch.Tensor, seg: Segments) -> torch.Tensor:
        """The combination of ``rows`` (m x V FP32, zero where not ``usable``: [m, T], which
        part may count in which tensor), a V-vector; 0 in a tensor no part may count in."""

    def unapplied(
        self, parts: Contributions, j: int
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Nothing: the rule takes no weights, so no weight left anything of part ``j`` out."""
        return torch.zeros(parts.numel, dtype=torch.float32, device=parts.values(j).device)

    def left_out(self) -> torch.Tensor | None:
        return self._left


def usable_rows(parts: Contributions, nonempty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every part's values stacked (m x V), zeroed where a part may not count, and where it may
    ([m, T]): present, and finite in that tensor (and with ``nonempty``, not all zero there)."""
    rows = parts.rows()
    top = parts.segments.max(rows.abs())
    usable = torch.isfinite(top)
    if nonempty:
        usable &= top > 0
    if parts.present is not None:
        usable &= parts.present[:, None]
    return torch.where(parts.segments.spread(usable), rows, 0.0), usable


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows``, one row after the other (the same bits on every receiver)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total += r
    return total


def divided(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count`` entry by entry, 0 where ``count`` is 0."""
    return torch.where(count > 0, total / count.clamp(min=1), 0.0)


def median_of(v: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
    """Each column's median over its usable entries (the mean of the middle two for an even
    count; 0 for a column with none): ``v`` and ``usable`` m x C."""
    c = usable.sum(dim=0)
    ordered = torch.where(usable, v, float("inf")).sort(dim=0).values
    lo = ((c - 1).clamp(min=0) // 2)[None]
    hi = (c // 2).clamp(max=v.shape[0] - 1)[None]
    a, b = ordered.gather(0, lo)[0], ordered.gather(0, hi)[0]
    return torch.where(c > 0, torch.where(c % 2 == 1, a, (a + b) / 2), 0.0)


def scale_to(norms: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """What each part's tensor is multiplied by to bring its norm (``norms``, m x T) down to
    ``bound`` (per tensor) where it is above it."""
    return torch.where(norms > bound, bound / norms.clamp_min(1e-30), 1.0)


def clipped_rows(rows: torch.Tensor, usable: torch.Tensor, seg: Segments) -> torch.Tensor:
    """``rows`` each scaled down, tensor by tensor, to the median norm of the usable parts."""
    norms = seg.sum(rows * rows).sqrt()
    return rows * seg.spread(scale_to(norms, median_of(norms, usable)))


def agreeing(
    clipped: torch.Tensor, total: torch.Tensor, usable: torch.Tensor, seg: Segments
) -> torch.Tensor:
    """Which usable (part, tensor) does not point against the sum of the others: a dot product
    with it of at least 0 (0 is no evidence), or the tensor's only usable part ([m, T])."""
    dot = seg.sum(clipped * (total - clipped))
    alone = usable.sum(dim=0) == 1
    return usable & (alone[None] | (dot >= 0))
