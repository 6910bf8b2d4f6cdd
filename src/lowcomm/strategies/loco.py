"""LoCo: 4-bit gradients every step with moving-average error compensation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Strategy, register
from .ddp import raise_inside

if TYPE_CHECKING:
    from ..config import TrainConfig


@register
class LoCo(Strategy):
    """A DDP comm hook that quantises gradients and compensates the error (Xie et al.)."""

    name = "loco"
    summary = "4-bit gradients every step, moving-average error compensation"
    settings = {"sync_every": 1, "codec": "loco", "compensation": "loco", "loco_beta": 0.8}
    per_step = True

    def check_sites(self, cfg: TrainConfig) -> None:
        """LoCo's hook does not run beside FSDP2 inside a worker yet."""
        if cfg.ranks_per_worker > 1:
            raise_inside(self.name, cfg.ranks_per_worker)

    def hook(self, cfg: TrainConfig) -> str:
        """LoCo's own hook, whatever ``ddp_hook`` says."""
        return "loco"
