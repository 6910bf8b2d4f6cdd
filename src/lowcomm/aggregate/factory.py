"""Choose the aggregator and its combine rule once: by method name (:func:`aggregator_for`) or
from a SyncConfig (:func:`make_aggregator`, which also resolves reduce=auto and builds the codec).

Which codec fits which exchange and rule is checked once, by the config's validation
(:func:`lowcomm.config.checks.validate_sync`); only what the rule object alone knows (whether it
is a sum, which the all-reduce and two-phase exchanges need) is checked when the aggregator is
built (:func:`~lowcomm.aggregate.combine.check_sum_only`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import SyncConfig
from .allreduce import AllReduceAggregator
from .base import Aggregator
from .combine import Combine, check_codec, combine_for
from .gather import GatherAggregator
from .two_phase import TwoPhaseAggregator

if TYPE_CHECKING:
    from ..codecs.base import Codec
    from ..compensation import Compensation

METHODS = ("allreduce", "gather", "two-phase")


def aggregator_for(
    method: str,
    codec: Codec | None,
    world_size: int,
    aggregation: str | Combine = "mean",
    dense_dtype: torch.dtype = torch.float32,
    reduce_compensation: Compensation | None = None,
) -> Aggregator:
    """The aggregator for ``method`` ("allreduce", "gather" or "two-phase") combining by the
    rule ``aggregation``; ValueError if the method is unknown or lacks its codec, ConfigError
    if it cannot run the rule. Settings the chosen exchange does not use are ignored."""
    if method not in METHODS:
        raise ValueError(f"unknown reduce method {method}")
    if method != "allreduce" and codec is None:
        raise ValueError(f"reduce={method} needs a codec")
    rule = combine_for(aggregation)
    check_codec(rule, codec)
    if method == "allreduce":
        return AllReduceAggregator(world_size, dense_dtype=dense_dtype, aggregation=rule)
    assert codec is not None
    if method == "gather":
        return GatherAggregator(codec, world_size, aggregation=rule)
    return TwoPhaseAggregator(
        codec, world_size, reduce_compensation=reduce_compensation, aggregation=rule
    )


def make_aggregator(cfg: SyncConfig, world_size: int) -> Aggregator:
    """The aggregator for a (validated) config: resolves reduce=auto and builds the codec."""
    method = cfg.resolved_reduce
    from ..codecs import make_codec  # the codec registry

    if method == "allreduce":  # a dense codec: its values are summed in its dtype
        dtype = make_codec(cfg.codec).dtype
        return aggregator_for(
            "allreduce", None, world_size, aggregation=cfg.resolved_aggregation, dense_dtype=dtype
        )
    from ..compensation import make_compensation

    codec = make_codec(
        cfg.codec,
        block_size=cfg.codec_block,
        density=cfg.density,
        value_bits=cfg.value_bits,
        kernels=cfg.kernels,
    )
    # the second quantisation is compensated by the same rule as the first (its own buffers,
    # each on the device of the shard it compensates)
    reduce_comp = make_compensation(cfg, device=None) if method == "two-phase" else None
    return aggregator_for(
        method,
        codec,
        world_size,
        aggregation=cfg.resolved_aggregation,
        reduce_compensation=reduce_comp,
    )
