"""The coordinate-wise trimmed mean (Yin et al., 2018): at each coordinate the ``b`` largest and
``b`` smallest values are dropped and the rest averaged, ``b`` a quarter of the sites (at least
one from three sites on), so up to ``b`` bad sites are trimmed wherever they push. Dense codecs
only, as ``median`` (top-k coordinates have one sender or none)."""

from __future__ import annotations

import math

import torch

from ._robust import Robust, mean_rows


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
        return min(max(1, math.floor(self.trim * n)), (n - 1) // 2)

    def robust(self, rows: torch.Tensor) -> torch.Tensor:
        b = self.dropped(rows.shape[0])
        if b == 0:
            return mean_rows(rows)
        return mean_rows(rows.sort(dim=0).values[b : rows.shape[0] - b])
