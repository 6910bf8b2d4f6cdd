"""Streaming DiLoCo: fragments synced in turn, overlapped with compute, FP4 on the wire."""

from __future__ import annotations

from .base import Strategy, register

SETTINGS = {
    "sync_every": 100,
    "blocks_per_fragment": 3,
    "overlap": 1,
    "alpha": 0.5,
    "codec": "fp4",
    "outer_optimizer": "nesterov",
    # tuned (benchmarks/results.md: 0.4 of 0.4/0.7/1.0 at H = 100; the paper's default too)
    "outer_lr": 0.4,
    "outer_momentum": 0.9,
}


@register
class Streaming(Strategy):
    """Douillard et al. 2025: fragments of 3 blocks, tau = 1, alpha = 0.5, FP4 outer gradients."""

    name = "streaming"
    summary = "fragments synced in turn, overlapped by tau steps, FP4 outer gradients"
    settings = SETTINGS
