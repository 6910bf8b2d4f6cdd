"""Codecs: a tensor <-> the bytes that really go on the wire.

``make_codec(name, **opts)`` builds one by its config name:

==========  =====================================================  ============================
name        format                                                 options
==========  =====================================================  ============================
fp32        dense IEEE float32 (exact)                             --
bf16        dense bfloat16 (round to nearest even)                 --
fp16        dense float16 (round to nearest even)                  --
int8/4/2    symmetric absmax per block, offset-binary codes        block_size=256, stochastic,
                                                                   generator
loco        int4 (the codec LoCo's compensation wraps)             as int4
fp4         FP4 E3M0, absmax per block                             block_size=256, stochastic,
                                                                   generator
topk        chunked top-k (64x64 tiles), packed indices + values   density=1/64, value_bits=2,
                                                                   value_codec=None (2-bit LUT)
==========  =====================================================  ============================

``int4-authors`` is the LoCo authors' int4 (absmax/8, codes -8..7 with the top clipped, round
half to even; option block_size=256); see ``int4_authors``.

A config may pass every codec knob to every codec: options of *other* codecs and options given
as None are ignored, while a name no codec knows (a typo) raises ValueError. Every payload
starts with a 16-byte header
(see ``_format``); block scales are fp32 and counted in ``nbytes``.
"""

from __future__ import annotations

from .base import Codec, PayloadError
from .dense import DenseCodec
from .fp4 import FP4Codec
from .int4_authors import AuthorsInt4Codec, authors_group_size
from .lut import LutCodec
from .topk import TopKCodec
from .uniform import UniformCodec

CODEC_NAMES: tuple[str, ...] = (
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int4",
    "int2",
    "fp4",
    "topk",
    "loco",
    "int4-authors",
)

_OPTIONS = {
    "fp32": (),
    "bf16": (),
    "fp16": (),
    "int8": ("block_size", "stochastic", "generator"),
    "int4": ("block_size", "stochastic", "generator"),
    "int2": ("block_size", "stochastic", "generator"),
    "loco": ("block_size", "stochastic", "generator"),
    "fp4": ("block_size", "stochastic", "generator"),
    "int4-authors": ("block_size",),
    "topk": ("density", "value_bits", "value_codec"),
}


def make_codec(name: str, **opts) -> Codec:
    """Build the codec called ``name`` (one of CODEC_NAMES) with its options."""
    if name not in _OPTIONS:
        raise ValueError(f"unknown codec {name!r}; valid names: {', '.join(CODEC_NAMES)}")
    known = {o for os_ in _OPTIONS.values() for o in os_}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown codec option(s) {unknown}; valid options: {sorted(known)}")
    opts = {k: v for k, v in opts.items() if v is not None and k in _OPTIONS[name]}
    if name in ("fp32", "bf16", "fp16"):
        return DenseCodec(name)
    if name in ("int8", "int4", "int2", "loco"):
        bits = 4 if name == "loco" else int(name[3:])
        return UniformCodec(bits, **opts)
    if name == "int4-authors":
        return AuthorsInt4Codec(**opts)
    if name == "fp4":
        return FP4Codec(**opts)
    if isinstance(opts.get("value_codec"), str):
        # a codec name is resolved here, by the registry: topk.py cannot import it (a cycle)
        opts["value_codec"] = make_codec(opts["value_codec"])
    return TopKCodec(**opts)


__all__ = [
    "AuthorsInt4Codec",
    "authors_group_size",
    "CODEC_NAMES",
    "Codec",
    "DenseCodec",
    "FP4Codec",
    "LutCodec",
    "PayloadError",
    "TopKCodec",
    "UniformCodec",
    "make_codec",
]
