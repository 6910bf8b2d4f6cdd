"""Named points of the one design space (docs/algorithms.md's table) as engine classes; each
method's settings live on its :mod:`lowcomm.strategies` object.

The classes are thin names over :class:`~lowcomm.engine.LowComm`; any knob can still be
overridden by keyword, e.g. ``SparseLoCo(model, opt, sync_every=30, density=1/32)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import strategies
from .config import SyncConfig, split_sync_kwargs
from .engine import LowComm
from .strategies import Strategy
from .strategies.co2 import co2_momentum


def preset_config(
    strategy: str | Strategy, workers: int | None = None, **overrides: Any
) -> SyncConfig:
    """The SyncConfig of a named strategy, with overrides applied and validated.

    ``workers`` (when known) sets what depends on the worker count: CO2's outer momentum.
    """
    return strategies.get(strategy).config(workers, **overrides)


__all__ = ["CO2", "DiLoCo", "SparseLoCo", "StreamingDiLoCo", "co2_momentum", "preset_config"]


def _worker_count(group: Any, mesh: Any) -> int | None:
    """How many workers sync: the mesh's replicate size, else the group's size (None before
    torch.distributed starts)."""
    if mesh is not None:
        from .engine.placement import check_mesh, workers_of

        check_mesh(mesh, group)
        return workers_of(mesh)
    return dist.get_world_size(group) if dist.is_initialized() else None


class _Preset(LowComm):
    strategy = ""

    def __init__(
        self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, **overrides: Any
    ) -> None:
        sync_kw, other = split_sync_kwargs(overrides)
        workers = _worker_count(other.get("process_group"), other.get("mesh"))
        config = preset_config(self.strategy, workers=workers, **sync_kw)
        super().__init__(model, inner_optimizer, config, **other)


class DiLoCo(_Preset):
    """DiLoCo: H local steps, then Nesterov outer step on the averaged pseudo-gradient."""

    strategy = "diloco"


class StreamingDiLoCo(_Preset):
    """Streaming DiLoCo: fragments synced in turn, overlapped by tau steps, FP4 outer gradients."""

    strategy = "streaming"


class SparseLoCo(_Preset):
    """SparseLoCo: top-k 2-bit pseudo-gradients with error feedback, plain SGD outer step."""

    strategy = "sparseloco"


class CO2(_Preset):
    """CO2: the outer all-reduce hidden behind a whole round, staleness penalty and clipping.

    Unless given, the outer momentum follows the authors' rule for the number of workers
    (:func:`co2_momentum`), read from the process group when it exists at construction.
    """

    strategy = "co2"
