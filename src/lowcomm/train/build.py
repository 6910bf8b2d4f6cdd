"""Build the model a run names: ``model=PRESET`` (our decoder, :mod:`lowcomm.train.model`) or
``model=hf:...`` (a Hugging Face causal LM, :mod:`lowcomm.hf`).

The one place the trainer composes the two, so neither imports the other: lowcomm.hf knows
nothing of our size presets, and ``hf:ARCH:PRESET`` is resolved here into the plain shape it is
handed. The trainer (set-up, launch checks, ``load_model``) and the benchmarks build through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn

from ..errors import ConfigError
from . import model as decoder

__all__ = ["build_model"]


def build_model(spec: str | decoder.ModelConfig, **overrides: Any) -> nn.Module:
    """The model ``spec`` names, with field overrides (e.g. ``vocab_size=50257``).

    ``hf:ARCH[:PRESET]`` or ``hf:PATH`` builds a Hugging Face model (needs lowcomm[hf]; only the
    overrides vocab_size and max_seq_len apply); anything else is
    :func:`lowcomm.train.model.build_model`'s.
    """
    if isinstance(spec, str) and spec.startswith("hf:"):
        return _build_hf(spec, overrides.get("vocab_size"), overrides.get("max_seq_len"))
    return decoder.build_model(spec, **overrides)


def _build_hf(spec: str, vocab_size: int | None, max_seq_len: int | None) -> nn.Module:
    try:
        from .. import hf  # optional extra: imported only when asked for
    except ImportError:
        raise ConfigError(
            f"model={spec} needs Hugging Face transformers: pip install 'lowcomm[hf]'"
        ) from None
    where = hf.parse_spec(spec[3:])
    if isinstance(where, Path):
        return hf.load_hf_model(where, vocab_size, max_seq_len)
    arch, preset = where
    return hf.build_hf_model(arch, _hf_shape(hf, preset), vocab_size or 256, max_seq_len)


def _hf_shape(hf: Any, preset: str) -> Any:
    """The ``lowcomm.hf.HFShape`` of one of our decoder's size presets."""
    if preset in decoder.RENAMED:
        raise ConfigError(decoder.unknown_preset(preset).replace("--model ", "hf:ARCH:"))
    if preset not in decoder.PRESETS:
        raise ConfigError(
            f"unknown size preset '{preset}' in hf:ARCH:PRESET: choose one of "
            f"{', '.join(decoder.PRESETS)}"
        )
    p = decoder.PRESETS[preset]
    return hf.HFShape(
        dim=p.dim,
        n_layers=p.n_layers,
        n_heads=p.n_heads,
        hidden=p.hidden,
        max_seq_len=p.max_seq_len,
    )
