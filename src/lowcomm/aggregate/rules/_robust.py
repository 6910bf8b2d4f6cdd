"""What the robust combine rules share (``median``, ``trimmed-mean``, ``centered-clip``,
``norm-clip``): they defend the merge against a minority of bad contributions, so they trust
nothing a contribution says about itself.

- A contribution that is not finite is dropped, whatever its validity flag says (a site's own
  flag is what a bad site controls).
- Every contribution counts once: a self-reported step weight (quorum rounds) would let a site
  buy influence by reporting more steps, so these rules take no weights, and what a weight
  left out of a part (:meth:`~lowcomm.aggregate.combine.Combine.unapplied`) is nothing.
- Each runs on the gather exchange, which hands every receiver every contribution in the same
  order; sums run in that order, so every receiver computes the same bits.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..combine import Combine, Parts


class Robust(Combine):
    """A rule over the finite contributions of one tensor, each counted once."""

    dense_only = True  # a coordinate's median or trim needs every site's value there

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        rows = finite_rows(parts)
        if rows.shape[0] == 0:  # nothing finite arrived: no step from this tensor
            return out.zero_()
        return out.copy_(self.robust(rows))

    @abstractmethod
    def robust(self, rows: torch.Tensor) -> torch.Tensor:
        """The combination of ``rows`` (n x d FP32, n >= 1, all finite), a d-vector."""

    def unapplied(self, parts: Parts, j: int) -> torch.Tensor:
        """Nothing: the rule takes no weights, so no weight left anything of part ``j`` out."""
        device = parts.payloads[j].device if parts.payloads else None
        return torch.zeros(parts.shape.numel(), dtype=torch.float32, device=device)


def finite_rows(parts: Parts) -> torch.Tensor:
    """The finite contributions of ``parts``, decoded and stacked in their order (n x d)."""
    rows = [x for x in parts if bool(torch.isfinite(x).all())]
    if not rows:
        return torch.empty(0, parts.shape.numel(), dtype=torch.float32)
    return torch.stack(rows)


def mean_rows(rows: torch.Tensor) -> torch.Tensor:
    """The mean of ``rows`` summed one row after the other (the same bits on every receiver)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total += r
    return total.div_(rows.shape[0])


def median_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each coordinate's median over ``rows``; with an even count, the mean of the middle two."""
    n = rows.shape[0]
    ordered = rows.sort(dim=0).values
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def median_of(values: torch.Tensor) -> torch.Tensor:
    """The median of a 1-d tensor (the mean of the middle two for an even count)."""
    return median_rows(values.reshape(-1, 1)).reshape(())


def clip_to(rows: torch.Tensor, norms: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``rows`` each scaled down to norm ``bound`` where its norm (``norms``) is above it."""
    scale = torch.where(norms > bound, bound / norms.clamp_min(1e-30), torch.ones_like(norms))
    return rows * scale.unsqueeze(1)
