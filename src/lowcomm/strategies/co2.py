"""CO2: the outer all-reduce hidden behind a whole round, outer momentum by worker count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import Strategy, register


def co2_momentum(workers: int) -> float:
    """Outer momentum by worker count, the CO2 authors' own rule: 0 up to 16, then 0.2/0.5/0.6."""
    for limit, momentum in ((16, 0.0), (32, 0.2), (64, 0.5)):
        if workers <= limit:
            return momentum
    return 0.6


@register
class CO2(Strategy):
    """Sun et al. 2024: whole-round overlap, continue merge keeping half of the own round."""

    name = "co2"
    summary = "outer all-reduce hidden behind the next round, staleness penalty, clipping"
    # continue merge keeping half of the own round in flight (tuned: benchmarks/results.md,
    # 0.5 of 0.5/0.75/1.0 at H = 48), penalty off (measured no better), momentum by worker
    # count (by_workers)
    settings = {
        "sync_every": 48,
        "overlap": -1,
        "outer_optimizer": "co2",
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "staleness_penalty": False,
        "momentum_clip": 0.0,
        "co2_merge": "continue",
        "co2_keep": 0.5,
    }

    def by_workers(self, workers: int | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """The authors' outer momentum for the worker count, unless given."""
        if workers is None or "outer_momentum" in overrides:
            return {}
        return {"outer_momentum": co2_momentum(workers)}
