"""Uniform symmetric integer codecs: int8, int4, int2.

Per block of ``block_size`` elements (default 256) with absmax ``s``, an element ``x`` becomes
the integer ``q = round(x * qmax / s)`` in ``[-qmax, qmax]`` with ``qmax = 2**(bits-1) - 1``
(127, 7, 1), and decodes to ``q * s / qmax``. The range is symmetric, as LoCo's absmax/7 int4:
the most negative code (``-2**(bits-1)``) is never produced, so int2 is ternary {-s, 0, +s}.
On the wire a code is stored offset-binary, ``q + 2**(bits-1)``, so the unused code is 0 and a
decoder rejects any 0 code (the unused fields of the last byte are padding: the encoder writes
the zero code ``2**(bits-1)`` there and a decoder ignores them). Two int4 / four int2 codes
per byte, planar (see bitpack).
Wire format: see ``block``. Bits per element: ``bits + 32 / block_size``.

Rounding: to nearest (ties to even), or stochastic with ``stochastic=True``
(``floor(y + u)`` with a 16-bit uniform dither u, unbiased). Error per element:
``|x - x'| <= s / (2 qmax)``
(RTN) or ``< s / qmax`` (stochastic), up to fp32 rounding.

Speed trick: adding ``2**23 + offset`` to ``x * qmax / s`` leaves ``round(.) + offset`` in the
low mantissa bits of the fp32 sum (the FPU does the rounding), so the code is the low byte of
its bit pattern: one add and one narrowing copy instead of round, add, clamp and convert.
"""

from __future__ import annotations

import torch

from ._format import div_scalar
from .block import DEFAULT_BLOCK_SIZE, BlockCodec, dither
from .registry import register

_MAGIC = float(2**23)
_OPTIONS = ("block_size", "stochastic", "generator")


@register("int8", wire_id=4, options=_OPTIONS, args={"bits": 8})
@register("int4", wire_id=5, options=_OPTIONS, args={"bits": 4})
@register("int2", wire_id=6, options=_OPTIONS, args={"bits": 2})
@register("loco", alias_of="int4")  # the codec LoCo's compensation wraps
class UniformCodec(BlockCodec):
    def __init__(
        self,
        bits: int = 8,
        block_size: int = DEFAULT_BLOCK_SIZE,
        stochastic: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if bits not in (8, 4, 2):
            raise ValueError(f"uniform codec bits must be 8, 4 or 2, got {bits}")
        self.bits = bits
        self.name = f"int{bits}"
        self.qmax = 2 ** (bits - 1) - 1
        self.offset = 2 ** (bits - 1)
        self.pad_code = self.offset
        self.invalid_codes = f"code 0, i.e. {-self.offset}"
        super().__init__(block_size, stochastic, generator)

    def quantize_rows(self, xb: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        s = self.block_absmax(xb, scales)
        work = torch.mul(xb, (self.qmax / s)[:, None])
        if self.stochastic:
            u = dither(work.numel(), self.generator, work.device).view(work.shape)
            # round(y + u - 1/2) = floor(y + u)
            work.add_(u.sub_(0.5)).clamp_(-self.qmax, self.qmax)
        # round-to-nearest-even into the low mantissa bits; codes land in [1, 2*qmax + 1]
        work.add_(_MAGIC + self.offset)
        codes.copy_(work.view(torch.int32).view(-1))  # narrowing keeps the low byte

    def dequantize_rows(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        out.copy_(codes.view(out.shape))
        out.sub_(float(self.offset)).mul_(div_scalar(scales, self.qmax)[:, None])
        return codes.amin() == 0  # (uint8 min is far faster than == / any on a CPU)

    def invalid(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.amin() == 0

    def triton_format(
        self, device: torch.device, decode: bool = False
    ) -> tuple[int, int, torch.Tensor | None]:
        return self.qmax, self.offset, None
