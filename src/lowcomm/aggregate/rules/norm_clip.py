"""Each contribution clipped to the median norm of all of them, then averaged (Templar's rule
for SparseLoCo with untrusted peers): a bad site may push as far as a typical one, no further.
One tensor at a time (the rule sees one tensor's contributions), so each tensor's norms are
compared with that tensor's.

Defined on dense and on sparse codecs: with top-k, each site's sent values are clipped to the
median norm of the sites' sent values, and the clipped values averaged over the sites that sent
each entry (the selected mean, as ``selected-mean``); a site that sent only zeros is left out
(Templar's rule counts it; in a selected mean it dilutes the entries it names)."""

from __future__ import annotations

import torch

from ..combine import Parts
from ._robust import Robust, clip_to, left_out, mean_rows, median_of, readable
from .selected_mean import selected_mean, tile_k


class NormClip(Robust):
    """Contributions scaled down to the median norm, then their (selected) mean."""

    name = "norm-clip"
    dense_only = False

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        if not hasattr(parts.codec, "decode_sparse"):
            return super().combine(parts, out)
        clipped, at = clipped_sparse(parts)
        self.excluded = left_out(parts, at)
        return selected_mean(clipped, None, out, tile_k(parts)) if clipped else out.zero_()

    def robust(self, rows: torch.Tensor) -> torch.Tensor:
        norms = rows.norm(dim=1)
        return mean_rows(clip_to(rows, norms, median_of(norms)))

    def unapplied(self, parts: Parts, j: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if hasattr(parts.codec, "decode_sparse"):  # nothing, in the codec's own form
            empty = torch.empty(0, dtype=torch.int64)
            return empty, torch.empty(0, dtype=torch.float32)
        return super().unapplied(parts, j)


def clipped_sparse(parts: Parts) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """A sparse codec's finite contributions (indices, values) that decode, in order, each
    scaled down to the median of their norms where above it. An empty one (every value 0: a
    free-rider, or a site with nothing to send) is left out: in the selected mean it would
    only dilute the entries it names, and in the median norm pull the bound down. Also which
    parts they are."""
    decoded = [(j, readable(parts, j, sparse=True)) for j in range(len(parts))]
    sent = [(j, x) for j, x in decoded if x is not None and bool(x[1].any())]
    if not sent:
        return [], []
    norms = torch.stack([v.norm() for _, (_, v) in sent])
    bound = median_of(norms)
    return [(i, v * _scale(n, bound)) for (_, (i, v)), n in zip(sent, norms)], [j for j, _ in sent]


def _scale(norm: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    return bound / norm if bool(norm > bound) else torch.ones((), dtype=torch.float32)
