"""The selected mean of a sparse codec's contributions: each entry averaged over the sites that
sent it (weighted: over their weights), as the SparseLoCo authors' code does."""

from __future__ import annotations

import torch

from ..combine import Combine, Contributions


class SelectedMean(Combine):
    """Each entry's (weighted) mean over the sites that sent it; 0 where none did. Needs a
    sparse codec (config: codec=topk); not a sum, so gather only."""

    name = "selected-mean"

    def combine(self, parts: Contributions, out: torch.Tensor) -> torch.Tensor:
        sent = [(parts.index(j), parts.values(j)) for j in range(len(parts))]
        return selected_mean(sent, parts.weights, out)

    def unapplied(self, parts: Contributions, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """At each entry part ``j`` sent: ``(1 - w_j c / W) v``, with ``c`` the count and ``W``
        the summed weights of the sites that sent that entry (the unweighted selected mean
        applies ``v / c`` of it, the weighted one ``w_j v / W``)."""
        assert parts.weights is not None
        idx, vals = parts.index(j), parts.values(j)
        counts = torch.zeros(parts.numel, dtype=torch.float32, device=vals.device)
        total = torch.zeros(parts.numel, dtype=torch.float32, device=vals.device)
        for i, w in enumerate(parts.weights):
            at = parts.index(i)
            counts.index_add_(0, at, torch.ones(at.numel(), device=vals.device))
            total.index_add_(0, at, torch.full((at.numel(),), w, device=vals.device))
        share = counts[idx] * parts.weights[j] / total[idx]
        return idx, vals * (1.0 - share)


def selected_mean(
    sent: list[tuple[torch.Tensor, torch.Tensor]],
    weights: list[float] | None,
    out: torch.Tensor,
    counted: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Each entry of ``sent`` (sites' flat indices and values into ``out``) averaged over the
    sites that sent it (weighted by ``weights``), into ``out``; 0 where none did.
    ``counted``: per site, which of its entries count (a robust rule's, whose left-out values
    are 0 in ``sent``); else all of them."""
    out.zero_()
    # counts are small integers, exact in any dtype: int16 halves the tensor-sized buffer
    dtype = (
        torch.float32 if weights or counted else torch.int16 if len(sent) < 2**15 else torch.int32
    )
    counts = torch.zeros(out.numel(), dtype=dtype, device=out.device)
    for j, (idx, vals) in enumerate(sent):
        weight = weights[j] if weights is not None else 1.0
        out.index_add_(0, idx, vals * weight if weights is not None else vals)
        if counted is not None:
            counts.index_add_(0, idx, counted[j].to(dtype))
        else:
            counts.index_add_(0, idx, torch.full_like(idx, weight, dtype=dtype))
    if counted is not None:  # an entry only left-out sites sent has no count: 0 there
        return out.copy_(torch.where(counts > 0, out / counts.clamp(min=1), 0.0))
    # divide only where something was sent: elsewhere the total is 0, and 0 / 1 = 0
    # (repeated positions write the same quotient)
    if sent:
        at = torch.cat([idx for idx, _ in sent])
        out.index_copy_(0, at, out[at] / counts[at])
    return out
