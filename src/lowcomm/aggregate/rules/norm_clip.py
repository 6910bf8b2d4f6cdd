"""Each contribution clipped to the median norm of all of them, then averaged (Templar's rule
for SparseLoCo with untrusted peers): a bad site may push as far as a typical one, no further.
Tensor by tensor, so each tensor's norms are compared with that tensor's.

Defined on dense and on sparse codecs: with top-k, each site's sent values are clipped to the
median norm of the sites' sent values, and the clipped values averaged over the sites that sent
each entry (the selected mean, as ``selected-mean``); a site that sent only zeros in a tensor is
left out of it (Templar's rule counts it; in a selected mean it dilutes the entries it names)."""

from __future__ import annotations

import torch

from ...segments import Segments
from ..combine import Contributions
from ._robust import Robust, clipped_rows, divided, sum_rows, usable_rows
from .selected_mean import selected_mean


class NormClip(Robust):
    """Contributions scaled down to the median norm, then their (selected) mean."""

    name = "norm-clip"
    dense_only = False

    def combine(self, parts: Contributions, out: torch.Tensor) -> torch.Tensor:
        if not parts.sparse:
            return super().combine(parts, out)
        clipped, usable = clipped_sparse(parts)
        self._left = ~usable
        return merged(parts, clipped, usable, out)

    def robust_rows(self, rows: torch.Tensor, usable: torch.Tensor, seg: Segments) -> torch.Tensor:
        count = seg.spread(usable.sum(dim=0))
        return divided(sum_rows(clipped_rows(rows, usable, seg)), count)

    def unapplied(
        self, parts: Contributions, j: int
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if parts.sparse:  # nothing, in the codec's own form
            empty = torch.empty(0, dtype=torch.int64, device=parts.values(j).device)
            return empty, torch.empty(0, dtype=torch.float32, device=empty.device)
        return super().unapplied(parts, j)


def clipped_sparse(parts: Contributions) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse codec's kept values (m x K), each part's tensor scaled down to the median norm
    of the usable parts' where above it, 0 where not usable; and which (part, tensor) is usable
    ([m, T]): present, finite and not empty (every value 0: a free-rider, or a site with
    nothing to send, would only dilute the entries it names and pull the bound down)."""
    values, usable = usable_rows(parts, nonempty=True)
    return clipped_rows(values, usable, parts.segments), usable


def merged(
    parts: Contributions, values: torch.Tensor, usable: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The selected mean of the usable (part, tensor)s' ``values`` (m x K) into ``out``."""
    each = parts.segments.spread(usable)
    sent = [(parts.index(j), values[j]) for j in range(len(parts))]
    return selected_mean(sent, None, out, counted=list(each.unbind(0)))
