"""The mean: ``sum_j w_j x_j / sum_j w_j`` (weights 1 unless quorum rounds weight each site by
the inner steps its pseudo-gradient holds)."""

from __future__ import annotations

import torch

from ..combine import SumCombine


class Mean(SumCombine):
    """The (weighted) mean."""

    name = "mean"

    def finish(self, total: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
        """``total / weight``; ``weight`` may be a 0-d tensor on the device (nothing read)."""
        return total.div_(_divisor(weight))


def _divisor(weight: float | torch.Tensor) -> float | torch.Tensor:
    # no contribution, or all of weight 0: what was summed (zeros) stays as it is
    if isinstance(weight, torch.Tensor):
        return torch.where(weight > 0, weight, 1.0)
    return weight if weight > 0 else 1.0
