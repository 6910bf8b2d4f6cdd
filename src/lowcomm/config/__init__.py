"""Configuration: every knob of docs/algorithms.md's table as a dataclass field, one name per knob.

The package re-exports everything, so ``from lowcomm.config import X`` is the import path:
``choices`` (the closed choices, as Literals), ``schema`` (SyncConfig: the engine's;
TrainConfig: the trainer's; each field with its help text), ``membership`` (MembershipConfig:
an elastic run's), ``checks`` (validation, run from ``__post_init__``) and ``parse`` (TOML and
``key=value`` into the tree of configs, ``--help``, :func:`split_sync_kwargs`). Nothing here
imports torch.
"""

from __future__ import annotations

from ..errors import ConfigError
from .checks import _LITERALS, _choice, check_types, validate_sync, validate_train
from .choices import (
    CODECS,
    DENSE_CODECS,
    Aggregation,
    Buffers,
    ClipMode,
    CO2Merge,
    Codec,
    Compensation,
    DdpHook,
    FragmentPattern,
    InnerParallel,
    LocoQuantizer,
    LogTo,
    Merge,
    OuterKind,
    Reduce,
    Shard,
    StateDevice,
)
from .membership import MembershipConfig, MembershipSettings
from .parse import (
    SAVED_BEFORE,
    Configs,
    _coerce,
    build_configs,
    config_fields,
    help_text,
    load_toml,
    nodes,
    parse_overrides,
    register_node,
    split_sync_kwargs,
)
from .schema import SyncConfig, TrainConfig, knob

__all__ = [
    "CODECS",
    "DENSE_CODECS",
    "SAVED_BEFORE",
    "Aggregation",
    "Buffers",
    "ClipMode",
    "CO2Merge",
    "Codec",
    "Compensation",
    "ConfigError",
    "Configs",
    "DdpHook",
    "FragmentPattern",
    "InnerParallel",
    "LocoQuantizer",
    "LogTo",
    "MembershipConfig",
    "MembershipSettings",
    "Merge",
    "OuterKind",
    "Reduce",
    "Shard",
    "StateDevice",
    "SyncConfig",
    "TrainConfig",
    "_LITERALS",
    "_choice",
    "_coerce",
    "build_configs",
    "check_types",
    "config_fields",
    "help_text",
    "knob",
    "load_toml",
    "nodes",
    "parse_overrides",
    "register_node",
    "split_sync_kwargs",
    "validate_sync",
    "validate_train",
]
