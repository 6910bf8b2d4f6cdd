"""DiLoCo: H local steps, then a Nesterov outer step on the averaged pseudo-gradient."""

from __future__ import annotations

from .base import Strategy, register


@register
class DiLoCo(Strategy):
    """Douillard et al. 2023: the whole model synced every H steps."""

    name = "diloco"
    summary = "H local steps, then a Nesterov outer step on the mean pseudo-gradient"
    settings = {
        "sync_every": 100,
        "outer_optimizer": "nesterov",
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
    }
