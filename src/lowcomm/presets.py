"""Named points of the one design space (docs/algorithms.md's table): each preset is a SyncConfig.

The classes are thin names over :class:`~lowcomm.engine.LowComm`; any knob can still be
overridden by keyword, e.g. ``SparseLoCo(model, opt, sync_every=30, density=1/32)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import ConfigError, SyncConfig, split_sync_kwargs
from .engine import LowComm

# Strategy name -> the SyncConfig fields that differ from the defaults. `ddp` and `loco` are
# per-step gradient reduction (no outer loop) and are handled by the trainer with DDP hooks.
STRATEGY_CONFIGS: dict[str, dict[str, Any]] = {
    "diloco": dict(sync_every=100, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9),
    "streaming": dict(
        sync_every=100,
        blocks_per_fragment=3,
        overlap=1,
        alpha=0.5,
        codec="fp4",
        outer_optimizer="nesterov",
        # tuned (benchmarks/results.md: 0.4 of 0.4/0.7/1.0 at H = 100; the paper's default too)
        outer_lr=0.4,
        outer_momentum=0.9,
    ),
    # selected-mean: measured better than the 1/M mean (benchmarks/sparseloco.md: 1.4814 vs 1.6458)
    "sparseloco": dict(
        sync_every=15,
        codec="topk",
        density=1 / 64,
        value_bits=2,
        reduce="gather",
        compensation="ef",
        error_decay=0.95,
        merge="continue",
        outer_optimizer="sgd",
        outer_lr=1.0,
    ),
    # continue merge keeping half of the own round in flight (tuned: benchmarks/results.md,
    # 0.5 of 0.5/0.75/1.0 at H = 48), penalty off (measured no better), momentum by worker
    # count (set at build)
    "co2": dict(
        sync_every=48,
        overlap=-1,
        outer_optimizer="co2",
        outer_lr=1.0,
        outer_momentum=0.0,
        staleness_penalty=False,
        momentum_clip=0.0,
        co2_merge="continue",
        co2_keep=0.5,
    ),
}
# Per-step strategies: no outer loop; only the gradient-compression knobs of SyncConfig apply.
PER_STEP_CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": dict(sync_every=1),
    "loco": dict(sync_every=1, codec="loco", compensation="loco", loco_beta=0.8),
}
PER_STEP_STRATEGIES = tuple(PER_STEP_CONFIGS)
# Peers: other libraries' implementations run by our trainer on the same model, data and link
# (optional extras; see lowcomm.peers.torchft). Same knobs as our DiLoCo and Streaming DiLoCo;
# torchft's streaming sends FP32 (its low-bit path needs CUDA).
PEER_CONFIGS: dict[str, dict[str, Any]] = {
    "torchft-diloco": dict(STRATEGY_CONFIGS["diloco"]),
    "torchft-streaming": {**STRATEGY_CONFIGS["streaming"], "codec": "fp32"},
}
STRATEGIES = PER_STEP_STRATEGIES + tuple(STRATEGY_CONFIGS) + tuple(PEER_CONFIGS)


def preset_config(strategy: str, workers: int | None = None, **overrides: Any) -> SyncConfig:
    """The SyncConfig of a named strategy, with overrides applied and validated.

    ``workers`` (when known) sets what depends on the worker count: CO2's outer momentum.
    """
    if strategy in PER_STEP_STRATEGIES:
        return SyncConfig(**{**PER_STEP_CONFIGS[strategy], **overrides})
    if strategy not in STRATEGY_CONFIGS and strategy not in PEER_CONFIGS:
        raise ConfigError(f"unknown strategy '{strategy}': choose one of {', '.join(STRATEGIES)}")
    base = dict(STRATEGY_CONFIGS.get(strategy) or PEER_CONFIGS[strategy])
    if "fragments" in overrides and "blocks_per_fragment" not in overrides:
        base["blocks_per_fragment"] = (
            0  # an explicit count replaces the preset's blocks per fragment
        )
    elif overrides.get("blocks_per_fragment", 0) > 0 and overrides.get("fragments", 1) > 1:
        raise ConfigError("give fragments (a count) or blocks_per_fragment, not both")
    if strategy == "co2" and workers is not None and "outer_momentum" not in overrides:
        base["outer_momentum"] = co2_momentum(workers)
    base.update(overrides)
    return SyncConfig(**base)


def co2_momentum(workers: int) -> float:
    """Outer momentum by worker count, the CO2 authors' own rule: 0 up to 16, then 0.2/0.5/0.6."""
    for limit, momentum in ((16, 0.0), (32, 0.2), (64, 0.5)):
        if workers <= limit:
            return momentum
    return 0.6


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
