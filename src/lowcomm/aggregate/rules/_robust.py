"""What the robust combine rules share (``median``, ``trimmed-mean``, ``centered-clip``,
``norm-clip``): they defend the merge against a minority of bad contributions, so they trust
nothing a contribution says about itself.

- A contribution that is not finite, or does not decode (a NaN scale, an index out of range),
  is dropped, whatever its validity flag says (a site's own flag is what a bad site controls);
  the plain rules stop the run on it instead (the sender named).
- Every contribution counts once: a self-reported step weight (quorum rounds) would let a site
  buy influence by reporting more steps, so these rules take no weights, and what a weight
  left out of a part (:meth:`~lowcomm.aggregate.combine.Combine.unapplied`) is nothing.
- Each runs on the gather exchange, which hands every receiver every contribution in the same
  order; sums run in that order, so every receiver computes the same bits.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from ...errors import PayloadError
from ..combine import Combine, Parts


class Robust(Combine):
    """A rule over the finite contributions of one tensor, each counted once."""

    dense_only = True  # a coordinate's median or trim needs every site's value there
    # the parts the last combine left out (indices into its parts): the gather exchange counts
    # a sender left out of most of its contribution as offending (engine/check.py, Offenders)
    excluded: list[int] = []

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        rows, at = finite_rows(parts)
        self.excluded = left_out(parts, at)
        if not at:  # nothing finite arrived: no step from this tensor
            return out.zero_()
        return out.copy_(self.robust(rows))

    @abstractmethod
    def robust(self, rows: torch.Tensor) -> torch.Tensor:
        """The combination of ``rows`` (n x d FP32, n >= 1, all finite), a d-vector."""

    def unapplied(self, parts: Parts, j: int) -> torch.Tensor:
        """Nothing: the rule takes no weights, so no weight left anything of part ``j`` out."""
        device = parts.payloads[j].device if parts.payloads else None
        return torch.zeros(parts.shape.numel(), dtype=torch.float32, device=device)


def readable(parts: Parts, j: int, sparse: bool = False) -> Any:
    """Part ``j`` decoded (``sparse``: as indices and values), or None if it does not decode
    or is not finite: every receiver reads the same bytes, so all drop the same parts."""
    try:
        got = parts.sparse(j) if sparse else parts[j]
    except PayloadError:
        return None
    values = got[1] if sparse else got
    return got if bool(torch.isfinite(values).all()) else None


def finite_rows(parts: Parts) -> tuple[torch.Tensor, list[int]]:
    """The finite contributions of ``parts`` that decode, stacked in their order (n x d), and
    which parts they are."""
    decoded = [(j, readable(parts, j)) for j in range(len(parts))]
    at = [j for j, x in decoded if x is not None]
    if not at:
        return torch.empty(0, parts.shape.numel(), dtype=torch.float32), at
    return torch.stack([x for _, x in decoded if x is not None]), at


def left_out(parts: Parts, at: list[int]) -> list[int]:
    """The indices of ``parts`` not in ``at`` (those a rule kept)."""
    kept = set(at)
    return [j for j in range(len(parts)) if j not in kept]


def sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows``, one row after the other (the same bits on every receiver)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total += r
    return total


def mean_rows(rows: torch.Tensor) -> torch.Tensor:
    """The mean of ``rows`` summed one row after the other (the same bits on every receiver)."""
    return sum_rows(rows).div_(rows.shape[0])


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
