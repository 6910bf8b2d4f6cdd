"""Data-parallel training: every step's gradients all-reduced (the baseline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ConfigError
from .base import Strategy, register

if TYPE_CHECKING:
    from ..config import TrainConfig


@register
class DDP(Strategy):
    """PyTorch DDP with a metered comm hook (FP32, or one of PyTorch's: bf16, PowerSGD)."""

    name = "ddp"
    summary = "data-parallel: every step's gradients all-reduced (ddp_hook picks the hook)"
    settings = {"sync_every": 1}
    per_step = True
    baseline = True

    def check_sites(self, cfg: TrainConfig) -> None:
        """Plain DDP runs as HSDP inside a multi-rank worker; PyTorch's compressing hooks do not."""
        if cfg.ranks_per_worker > 1 and cfg.ddp_hook != "allreduce":
            raise_inside(f"ddp_hook={cfg.ddp_hook}", cfg.ranks_per_worker)


def raise_inside(what: str, ranks: int) -> None:
    """The one-line refusal of a method inside a worker of several ranks."""
    raise ConfigError(
        f"{what} does not run inside a worker of {ranks} ranks yet (FSDP2 does that traffic): "
        f"use ranks_per_worker=1, or an outer-loop strategy or plain ddp"
    )
