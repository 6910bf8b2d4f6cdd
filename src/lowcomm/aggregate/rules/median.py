"""The coordinate-wise median of the contributions (Yin et al., 2018): each coordinate's median
over the sites; with an even count, the mean of the middle two. A minority of bad sites moves no
coordinate past the honest sites' range. Dense codecs only: at top-k's density most coordinates
have one sender or none, so a median over senders defends nothing, and one that counts the
non-senders as zeros zeroes the update; use ``cosine-clip`` there."""

from __future__ import annotations

import torch

from ...segments import Segments
from ._robust import Robust, median_of


class Median(Robust):
    """Each coordinate's median over the finite contributions (gather only)."""

    name = "median"

    def robust_rows(self, rows: torch.Tensor, usable: torch.Tensor, seg: Segments) -> torch.Tensor:
        return median_of(rows, seg.spread(usable))
