"""The selected mean of a sparse codec's contributions: each entry averaged over the sites that
sent it (weighted: over their weights), as the SparseLoCo authors' code does."""

from __future__ import annotations

import torch

from ...codecs import _native
from ..combine import Combine, Parts


class SelectedMean(Combine):
    """Each entry's (weighted) mean over the sites that sent it; 0 where none did. Needs a
    sparse codec (config: codec=topk); not a sum, so gather only."""

    name = "selected-mean"

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        sent = [parts.sparse(j) for j in range(len(parts))]
        return selected_mean(sent, parts.weights, out, tile_k(parts))

    def unapplied(self, parts: Parts, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """At each entry part ``j`` sent: ``(1 - w_j c / W) v``, with ``c`` the count and ``W``
        the summed weights of the sites that sent that entry (the unweighted selected mean
        applies ``v / c`` of it, the weighted one ``w_j v / W``)."""
        assert parts.weights is not None
        idx, vals = parts.sparse(j)
        n = parts.shape.numel()
        counts = torch.zeros(n, dtype=torch.float32, device=vals.device)
        total = torch.zeros(n, dtype=torch.float32, device=vals.device)
        for i, w in enumerate(parts.weights):
            at = parts.sparse(i)[0]
            counts.index_add_(0, at, torch.ones(at.numel(), device=vals.device))
            total.index_add_(0, at, torch.full((at.numel(),), w, device=vals.device))
        share = counts[idx] * parts.weights[j] / total[idx]
        return idx, vals * (1.0 - share)


def tile_k(parts: Parts) -> int:
    """Values per tile of ``parts``' top-k codec at its shape (0 for a codec without tiles)."""
    geometry = getattr(parts.codec, "geometry", None)
    return geometry(parts.shape).k if geometry else 0


def selected_mean(
    sent: list[tuple[torch.Tensor, torch.Tensor]],
    weights: list[float] | None,
    out: torch.Tensor,
    k: int = 0,
) -> torch.Tensor:
    """Each entry of ``sent`` (sites' flat indices and values into ``out``) averaged over the
    sites that sent it (weighted by ``weights``), into ``out``. ``k``: one tensor's values per
    top-k tile, for the fused CPU kernel (0: not one tensor's, no kernel)."""
    out.zero_()
    if _fused(sent, weights, k, out):
        return out
    # counts are small integers, exact in any dtype: int16 halves the tensor-sized buffer
    dtype = torch.float32 if weights else torch.int16 if len(sent) < 2**15 else torch.int32
    counts = torch.zeros(out.numel(), dtype=dtype, device=out.device)
    touched = []  # where some site sent a value
    for j, (idx, vals) in enumerate(sent):
        weight = weights[j] if weights is not None else 1.0
        out.index_add_(0, idx, vals * weight if weights is not None else vals)
        counts.index_add_(0, idx, torch.full_like(idx, weight, dtype=dtype))
        touched.append(idx)
    # divide only where something was sent: elsewhere the total is 0, and 0 / 1 = 0
    # (repeated positions write the same quotient)
    if touched:
        at = torch.cat(touched)
        out.index_copy_(0, at, out[at] / counts[at])
    return out


def _fused(
    sent: list[tuple[torch.Tensor, torch.Tensor]],
    weights: list[float] | None,
    k: int,
    out: torch.Tensor,
) -> bool:
    """The selected mean of one tensor's sparse contributions (each a site's indices,
    increasing within tiles of ``k``, and values) into ``out`` (zeroed) with the fused kernel:
    the same bits as index_add_ and a division; False where it is not available."""
    tensors = [t for pair in sent for t in pair]
    kernels = _native.usable(out, *tensors) if sent and k > 0 else None
    if kernels is None:
        return False
    w32 = torch.tensor(weights, dtype=torch.float32) if weights is not None else None
    return not kernels.lc_selected_mean(
        len(sent),
        _native.addresses([i for i, _ in sent]),
        _native.addresses([v for _, v in sent]),
        None if w32 is None else _native.ptr(w32),
        sent[0][0].numel(),
        k,
        _native.ptr(out),
    )
