"""The coordinate-wise trimmed mean (Yin et al., 2018): at each coordinate the ``b`` largest and
``b`` smallest values are dropped and the rest averaged, ``b`` a quarter of the sites (at least
one from three sites on), so up to ``b`` bad sites are trimmed wherever they push. Dense codecs
only, as ``median`` (top-k coordinates have one sender or none)."""

from __future__ import annotations

import torch

from ...segments import Segments
from ._robust import Robust, divided


class TrimmedMean(Robust):
    """Each coordinate's mean after dropping its ``b`` lowest and ``b`` highest values."""

    name = "trimmed-mean"

    def __init__(self, trim: float = 0.25) -> None:
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        self.trim = trim  # the share of the sites dropped at each end

    def dropped(self, n: int) -> int:
        """``b``: how many values are dropped at each end of a coordinate's ``n``."""
        if n < 3 or self.trim == 0:
            return 0
        return min(max(1, int(self.trim * n)), (n - 1) // 2)

    def robust_rows(self, rows: torch.Tensor, usable: torch.Tensor, seg: Segments) -> torch.Tensor:
        c = usable.sum(dim=0)  # per tensor
        b = torch.tensor([self.dropped(n) for n in range(rows.shape[0] + 1)], device=c.device)[c]
        c, b = seg.spread(c), seg.spread(b)
        ordered = torch.where(seg.spread(usable), rows, float("inf")).sort(dim=0).values
        at = torch.arange(rows.shape[0], device=rows.device)[:, None]
        kept = (at >= b) & (at < c - b)
        return divided(torch.where(kept, ordered, 0.0).sum(dim=0), c - 2 * b)
