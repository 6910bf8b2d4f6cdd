"""Codecs: a tensor <-> the bytes that really go on the wire.

``make_codec(name, **opts)`` builds one by its config name. Each codec's file declares it with
``@register(name, wire_id=..., options=..., ...)`` on its class (see ``registry``) and describes
its format in its docstring; ``CODEC_NAMES`` and every other list of codecs derive from those
declarations. Today: fp32/bf16/fp16 (dense), int8/int4/int2 and fp4 (absmax per block; ``loco``
is int4), topk (chunked top-k, SparseLoCo) and int4-authors (the LoCo authors' int4).

A config may pass every codec knob to every codec: options of *other* codecs and options given
as None are ignored, while a name no codec knows (a typo) raises ValueError. Every payload
starts with a 16-byte header (see ``_format``); block scales are fp32 and counted in ``nbytes``.

Importing this package does not import torch (the config reads the registry); the codec
classes below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import PayloadError
from .registry import CodecSpec, codec_names, make_codec, register, specs

#: the names ``make_codec`` and ``codec=NAME`` accept, in the order configs list them
CODEC_NAMES: tuple[str, ...] = codec_names(core=True)

# public name -> the module that defines it (imported on first access: those import torch)
_LAZY = {
    "Codec": "base",
    "DenseCodec": "dense",
    "FP4Codec": "fp4",
    "LutCodec": "lut",
    "TopKCodec": "topk",
    "UniformCodec": "uniform",
}


def __getattr__(name: str) -> Any:
    """Load a codec class (and torch) when it is first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = [
    "CODEC_NAMES",
    "Codec",
    "CodecSpec",
    "DenseCodec",
    "FP4Codec",
    "LutCodec",
    "PayloadError",
    "TopKCodec",
    "UniformCodec",
    "codec_names",
    "make_codec",
    "register",
    "specs",
]
