"""What LoCo's per-step hooks (DDP and FSDP2) share: the quantiser choice and loss scaling.

Two 4-bit quantisers (docs/algorithms.md, LoCo):

- ``ours`` (codec ``int4``): scale absmax/7, codes -7..7, flat groups of ``group_size``
  (128: 4.25 bits per element with the fp32 scales);
- ``authors`` (codec ``int4-authors``): scale absmax/8, codes -8..7 with the top clipped, round
  half to even, one group per ``min(rows, cols)`` elements of each matrix (about 4.0 bits per
  element on a large matrix), as in the LoCo authors' DeepSpeed kernels.

Default: ``ours``, for the lower error on transformer-sized matrices. Measured side by side
(``test_quantizer_errors_side_by_side`` in tests/test_loco.py, 768 x 2048 matrices), relative
error of one quantisation, Gaussian / heavy-tailed (Student-t, 3 d.o.f.) entries:

- absmax/8 on groups of 128: 0.106 / 0.20 -- the authors' rule is the better one per group;
- ours (absmax/7, groups of 128): 0.117 / 0.22;
- the authors' as shipped (absmax/8, groups of min(rows, cols) = 768): 0.122 / 0.33.

Their groups are a whole matrix row on a real model, and the larger groups cost more than the
finer step saves; they spend 0.21 bit per element less. On small matrices (min(rows, cols) <
128, as in the test models) the authors' groups are the smaller ones and win. The quality
benchmark (docs/benchmarking.md) decides the default for good. The absmax/8 rule on groups of
128 is codec ``int4-authors`` with ``codec_block=128`` (the outer loop's codecs).
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import Codec, make_codec
from ..errors import ConfigError


def authors_group_size(shape: torch.Size | tuple[int, ...], fallback: int) -> int:
    """The authors' group for a tensor: ``min(rows, cols)`` of its matrix view (rows = dim 0).

    A 1-D or 0-d tensor has no such matrix (the authors never quantise one): ``fallback``.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2 or 0 in shape:
        return fallback
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    return max(1, min(rows, cols))


QUANTIZERS = ("ours", "authors")
DEFAULT_QUANTIZER = "ours"


def check_quantizer(quantizer: str, bits: int) -> None:
    """Raise ConfigError on an unknown quantiser or one that cannot do ``bits``."""
    if quantizer not in QUANTIZERS:
        raise ConfigError(
            f"unknown LoCo quantizer {quantizer!r}: choose one of {', '.join(QUANTIZERS)}"
        )
    if quantizer == "authors" and bits != 4:
        raise ConfigError(
            f"the authors' quantizer is 4-bit only, got bits={bits}: use bits=4 or quantizer=ours"
        )
    if bits not in (2, 4, 8):
        raise ConfigError(f"LoCo bits must be 2, 4 or 8, got {bits}")


def loco_codec(quantizer: str, bits: int, group: int) -> Codec:
    """The codec that quantises with ``quantizer`` in groups of ``group`` elements."""
    if quantizer == "authors":
        return make_codec("int4-authors", block_size=group)
    return make_codec(f"int{bits}", block_size=group)


def group_for(quantizer: str, shape: torch.Size, group_size: int) -> int:
    """Scale-group size for a tensor: ``group_size`` (ours) or the authors' ``min(rows, cols)``."""
    if quantizer == "authors":
        return authors_group_size(shape, fallback=group_size)
    return group_size


class LossScale:
    """Keeps compensation buffers in step with an fp16 loss scale (they hold scaled errors).

    ``update(scale)`` with the scale of the coming backward pass (the first call only records
    it): a lower scale means the scaler backed off after an overflow, so the buffers are
    dropped; a higher one rescales them by new / old.
    """

    def __init__(self, *compensations: Any) -> None:
        self.compensations = [c for c in compensations if c is not None]
        self.scale: float | None = None

    def update(self, scale: float) -> None:
        """Tell the buffers the loss scale of the next backward pass."""
        scale = float(scale)
        if self.scale is not None and scale != self.scale:
            for c in self.compensations:
                if scale < self.scale:
                    c.reset()
                else:
                    c.rescale(scale / self.scale)
        self.scale = scale

    def follow(self, scaler: Any) -> None:
        """``update`` from a ``torch.amp.GradScaler`` (call after ``scaler.update()``)."""
        if scaler.is_enabled():
            self.update(float(scaler.get_scale()))

    def reset(self) -> None:
        """Drop every buffer (an overflow was seen)."""
        for c in self.compensations:
            c.reset()
