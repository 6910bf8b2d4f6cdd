"""The mean: ``sum_j w_j x_j / sum_j w_j`` (weights 1 unless quorum rounds weight each site by
the inner steps its pseudo-gradient holds)."""

from __future__ import annotations

import torch

from ..combine import Parts, SumCombine


class Mean(SumCombine):
    """The (weighted) mean; where the codec has a fused decode-and-mean kernel, that (same bits)."""

    name = "mean"

    def finish(self, total: torch.Tensor, weight: float) -> torch.Tensor:
        return total.div_(_divisor(weight))

    def combine(self, parts: Parts, out: torch.Tensor) -> torch.Tensor:
        fused = getattr(parts.codec, "decode_mean", None)
        divisor = _divisor(parts.total_weight())
        if fused is not None and fused(
            parts.payloads, parts.shape, out, parts.weights, divisor, parts.names
        ):
            return out
        return super().combine(parts, out)


def _divisor(weight: float) -> float:
    # no contribution, or all of weight 0: what was summed (zeros) stays as it is
    return weight if weight > 0 else 1.0
