"""The checks of the config: a setting that cannot work raises ConfigError naming the fix.

Functions of plain config objects (the dataclasses of :mod:`lowcomm.config.schema` call them
from ``__post_init__``), so the schema imports the checks and not the other way round.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal, get_args

from .. import plugins
from ..codecs.registry import codec_names
from ..errors import ConfigError
from . import choices
from .choices import (
    AGGREGATIONS,
    CODECS,
    DENSE_CODECS,
    DENSE_ONLY_RULES,
    SPARSE_CODECS,
    SUM_RULES,
)

# annotation name -> its Literal: every Literal that choices.py defines
_LITERALS = {
    name: value
    for name, value in vars(choices).items()
    if getattr(value, "__origin__", None) is Literal
}
# annotation name -> its choices: the Literals', the codec registry's and the combine rules' names
_CHOICES = {name: get_args(lit) for name, lit in _LITERALS.items()} | {
    "Codec": CODECS,
    "Aggregation": AGGREGATIONS,
}


def _codecs(value: str) -> tuple[str, ...]:
    """The codec names a config may give: the core's, and a plugin's where ``value`` is none
    of those (the plugins are loaded then)."""
    if value not in CODECS and plugins.load():
        return codec_names()
    return codec_names() if value not in CODECS else CODECS


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} '{value}': choose one of {', '.join(allowed)}")


def check_types(cfg: Any) -> None:
    """ConfigError unless every field of the dataclass ``cfg`` holds a value of its declared kind.

    ints must be ints (not bools, not 10.5), floats may be given as ints, bools must be bools,
    and Literal fields (and ``codec``, the registry's names) one of their choices; the message
    names the field and what to pass.
    """
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind in _CHOICES:
            allowed = _codecs(value) if kind == "Codec" else _CHOICES[kind]
            if not isinstance(value, str):
                raise ConfigError(f"{f.name} must be one of {', '.join(allowed)}; got {value!r}")
            _choice(f.name, value, allowed)
        elif kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{f.name} must be True or False, got {value!r}")
        elif kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{f.name} must be a whole number, got {value!r}")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{f.name} must be a number, got {value!r}")
            object.__setattr__(cfg, f.name, float(value))
        elif kind == "str" and not isinstance(value, str):
            raise ConfigError(f"{f.name} must be a string, got {value!r}")


def alpha_mixes(overlap: int, merge: str, co2_merge: str) -> bool:
    """Whether a result enters the local weights by the alpha-mix: only one that lands tau >= 1
    steps late, under merge=alpha (CO2's whole round, overlap=-1: under co2_merge=reset)."""
    if overlap == -1:
        return co2_merge == "reset"
    return overlap > 0 and merge == "alpha"


def _why_no_mix(cfg: Any) -> str:
    if cfg.overlap == 0:
        return (
            "with overlap=0 a sync's result replaces the local weights (torchft's DiLoCo mixes "
            "at fragment_sync_delay=0; lowcomm mixes only a result that lands late): set "
            "overlap >= 1, or drop alpha"
        )
    if cfg.overlap == -1:
        return "CO2's whole round merges by co2_merge=continue: set co2_merge=reset, or drop alpha"
    return "merge=continue keeps the steps taken since the send: set merge=alpha, or drop alpha"


def validate_sync(cfg: Any) -> None:
    """Raise ConfigError on any SyncConfig setting that cannot work."""
    check_types(cfg)
    if cfg.sync_every < 1:
        raise ConfigError(
            f"sync_every (H) must be >= 1, got {cfg.sync_every}: set sync_every=1 or more"
        )
    if cfg.fragments < 1:
        raise ConfigError(f"fragments (P) must be >= 1, got {cfg.fragments}")
    if cfg.blocks_per_fragment < 0:
        raise ConfigError(f"blocks_per_fragment must be >= 0, got {cfg.blocks_per_fragment}")
    if cfg.blocks_per_fragment > 0 and cfg.fragments > 1:
        raise ConfigError(
            f"fragments={cfg.fragments} and blocks_per_fragment="
            f"{cfg.blocks_per_fragment} both set P: give one (blocks_per_fragment=0 "
            f"to use the count)"
        )
    if cfg.overlap < -1:
        raise ConfigError(f"overlap (tau) must be >= 0, or -1 for a whole round; got {cfg.overlap}")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {cfg.alpha}")
    if cfg.alpha and not alpha_mixes(cfg.overlap, cfg.merge, cfg.co2_merge):
        raise ConfigError(f"alpha={cfg.alpha} does nothing here: {_why_no_mix(cfg)}")
    if not 0.0 < cfg.density <= 1.0:
        raise ConfigError(f"density must be in (0, 1], got {cfg.density}")
    if cfg.value_bits not in (1, 2, 4, 8, 32):
        raise ConfigError(f"value_bits must be one of 1, 2, 4, 8, 32; got {cfg.value_bits}")
    if not 0.0 <= cfg.error_decay <= 1.0:
        raise ConfigError(f"error_decay must be in [0, 1], got {cfg.error_decay}")
    if not 0.0 <= cfg.loco_beta < 1.0:
        raise ConfigError(f"loco_beta must be in [0, 1), got {cfg.loco_beta}")
    if cfg.loco_bits not in (2, 4, 8):
        raise ConfigError(f"loco_bits must be 2, 4 or 8, got {cfg.loco_bits}")
    if cfg.outer_lr <= 0:
        raise ConfigError(f"outer_lr must be > 0, got {cfg.outer_lr}")
    if not 0.0 <= cfg.co2_keep <= 1.0:
        raise ConfigError(f"co2_keep must be in [0, 1], got {cfg.co2_keep}")
    if not 0.0 <= cfg.outer_momentum < 1.0:
        raise ConfigError(f"outer_momentum must be in [0, 1), got {cfg.outer_momentum}")
    if cfg.momentum_clip < 0:
        raise ConfigError(f"momentum_clip must be >= 0 (0 = off), got {cfg.momentum_clip}")
    if cfg.nonfinite_patience < 1:
        raise ConfigError(f"nonfinite_patience must be >= 1, got {cfg.nonfinite_patience}")
    _check_offenders(cfg)
    if not cfg.update_bound >= 0:
        raise ConfigError(f"update_bound must be >= 0 (0 = off), got {cfg.update_bound}")
    if cfg.replica_check_every < 0:
        raise ConfigError(f"replica_check_every must be >= 0, got {cfg.replica_check_every}")
    if cfg.codec_block < 1:
        raise ConfigError(f"codec_block must be >= 1, got {cfg.codec_block}")
    if cfg.bucket_mb <= 0:
        raise ConfigError(f"bucket_mb must be > 0, got {cfg.bucket_mb}")
    # which codec fits which exchange and rule: checked here only (the aggregate relies on it)
    if cfg.reduce == "allreduce" and cfg.codec not in DENSE_CODECS:
        raise ConfigError(
            f"reduce=allreduce needs a dense codec ({', '.join(DENSE_CODECS)}), "
            f"got codec={cfg.codec}: use reduce=gather or reduce=two-phase"
        )
    if cfg.aggregation == "selected-mean" and cfg.codec not in SPARSE_CODECS:
        raise ConfigError(
            f"aggregation=selected-mean needs codec={'|'.join(SPARSE_CODECS)} "
            f"(got codec={cfg.codec}): "
            f"use aggregation=mean or auto"
        )
    if cfg.aggregation in DENSE_ONLY_RULES and cfg.codec in SPARSE_CODECS:
        raise ConfigError(
            f"aggregation={cfg.aggregation} defends nothing on top-k payloads (most coordinates "
            f"have one sender or none): use aggregation=cosine-clip (or norm-clip), or a "
            f"dense codec"
        )
    if cfg.reduce == "two-phase" and cfg.codec not in codec_names(elementwise=True):
        raise ConfigError(
            f"reduce=two-phase needs an element-wise codec; {cfg.codec} encodes whole "
            f"tensors: use reduce=gather"
        )
    if cfg.reduce in ("allreduce", "two-phase") and cfg.resolved_aggregation not in SUM_RULES:
        raise ConfigError(
            f"aggregation={cfg.resolved_aggregation} is not a sum and reduce={cfg.reduce} can "
            f"only sum: use reduce=gather (or auto)"
        )


def validate_train(t: Any) -> None:
    """Raise ConfigError for trainer settings that cannot work."""
    check_types(t)
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "threads",
        "eval_batches",
        "log_every",
        "ranks_per_worker",
    ):
        if getattr(t, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(t, name)}")
    for name in ("warmup_steps", "eval_every", "checkpoint_every"):
        if getattr(t, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(t, name)}")
    if t.batch_size % t.ranks_per_worker:
        raise ConfigError(
            f"batch_size={t.batch_size} does not split over ranks_per_worker="
            f"{t.ranks_per_worker}: give a multiple of {t.ranks_per_worker}"
        )
    if t.inner_lr <= 0:
        raise ConfigError(f"inner_lr must be > 0, got {t.inner_lr}")
    if t.timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {t.timeout_s}")
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {t.device}")
    if t.powersgd_rank < 1:
        raise ConfigError(f"powersgd_rank must be >= 1, got {t.powersgd_rank}")
    if t.powersgd_start < 2:
        raise ConfigError(
            f"powersgd_start must be >= 2 (PyTorch's PowerSGD needs two plain steps), "
            f"got {t.powersgd_start}"
        )


def _check_offenders(cfg: Any) -> None:
    """offender_syncs and evict: what they need, one line each."""
    if cfg.offender_syncs < 0:
        raise ConfigError(f"offender_syncs must be >= 0 (0 = never), got {cfg.offender_syncs}")
    if cfg.evict and not cfg.offender_syncs:
        raise ConfigError("evict=true excludes the sites offender_syncs names: set it >= 1")
    if cfg.evict and cfg.resolved_aggregation in SUM_RULES:
        raise ConfigError(
            f"evict=true tells sites apart by their contributions, which only a robust "
            f"aggregation sees (this run: {cfg.resolved_aggregation}): set aggregation=norm-clip "
            f"(or median, trimmed-mean, centered-clip)"
        )
