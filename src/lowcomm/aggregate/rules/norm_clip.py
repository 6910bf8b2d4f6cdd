"""Each contribution clipped to the median norm of all of them, then averaged (Templar's rule
for SparseLoCo with untrusted peers): a bad site may push as far as a typical one, no further.
One tensor at a time (the rule sees one tensor's contributions), so each tensor's norms are
compared with that tensor's.

Defined on dense and on sparse codecs: with top-k, each site's sent values are clipped to the
median norm of the sites' sent values, and the clipped values averaged over the sites that sent
each entry (the selected mean, as ``selected-mean``)."""

from __future__ import annotations

import torch

from ..combine import Parts
from ._robust import Robust, clip_to, mean_rows, median_of
from .selected_mean import selected_mean


class NormClip(Robust):
    """Contributions scaled down to the median norm, then their (selected) mean."""

    name = "norm-clip"
    dense_only = False

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        if not hasattr(parts.codec, "decode_sparse"):
            return super().combine(parts, out)
        sent = [parts.sparse(j) for j in range(len(parts))]
        sent = [(i, v) for i, v in sent if bool(torch.isfinite(v).all())]
        if not sent:
            return out.zero_()
        norms = torch.stack([v.norm() for _, v in sent])
        bound = median_of(norms)
        clipped = [(i, v * _scale(n, bound)) for (i, v), n in zip(sent, norms)]
        return selected_mean(clipped, None, parts, out)

    def robust(self, rows: torch.Tensor) -> torch.Tensor:
        norms = rows.norm(dim=1)
        return mean_rows(clip_to(rows, norms, median_of(norms)))

    def unapplied(self, parts: Parts, j: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if hasattr(parts.codec, "decode_sparse"):  # nothing, in the codec's own form
            empty = torch.empty(0, dtype=torch.int64)
            return empty, torch.empty(0, dtype=torch.float32)
        return super().unapplied(parts, j)


def _scale(norm: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    return bound / norm if bool(norm > bound) else torch.ones((), dtype=torch.float32)
