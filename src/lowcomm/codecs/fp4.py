"""FP4 E3M0: the Streaming DiLoCo 4-bit float (1 sign bit, 3 exponent bits, no mantissa).

Scaling (the paper leaves it open; our choice): one fp32 scale per block of ``block_size``
elements (default 256), the block's absmax ``s``. A 4-bit code is ``sign << 3 | e`` with
``e`` in 0..7: ``e = 0`` is zero, ``e >= 1`` is ``+-s * 2**(e - 7)``, so magnitudes
{0, s/64, s/32, ..., s/2, s} (the block max is exact). The code ``0b1000`` (negative zero) is
never produced and a decoder rejects it. Two codes per byte, planar (see bitpack); header and
scales as in ``block``. Bits per element: ``4 + 32 / block_size``.

Rounding to nearest in linear terms: ``|x|/s`` goes to the nearest of the 8 magnitudes (ties
up), i.e. to the nearest power of two when ``|x| >= s/128`` and to zero below. Error per
element: ``|x - x'| <= max(|x| / 3, s / 128)``. With ``stochastic=True`` it rounds to one of the
two neighbouring magnitudes with probabilities that make it unbiased (``E[x'] = x``); error
``<= max(|x|, s / 64)``.

Speed trick: the top 10 bits of the fp32 pattern of ``x/s`` (sign, 8 exponent bits and the
first mantissa bit, which says whether the value is past 1.5x its power of two) determine the
nearest code, so encoding is a multiply, a shift, a mask and a table lookup.
"""

from __future__ import annotations

import torch

from .block import BlockCodec, dither
from .registry import register


def _encode_table() -> torch.Tensor:
    t = torch.zeros(1024, dtype=torch.uint8)
    for idx in range(1024):
        sign, biased_exp, half = idx >> 9, (idx >> 1) & 0xFF, idx & 1
        if biased_exp < 120:  # |x|/s < 2**-7: nearer to 0 than to 2**-6
            continue
        e = min(max(biased_exp - 120 + half, 1), 7)
        t[idx] = (sign << 3) | e
    return t


def _decode_table() -> torch.Tensor:
    t = torch.zeros(16, dtype=torch.float32)
    for code in range(16):
        e = code & 7
        if e:
            t[code] = (-1.0 if code & 8 else 1.0) * 2.0 ** (e - 7)
    return t


_ENC = _encode_table()
_DEC = _decode_table()
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the code of each 10-bit key, the value of each code) on ``device``."""
    if device not in _TABLES:
        _TABLES[device] = (_ENC.to(device), _DEC.to(device))
    return _TABLES[device]


@register("fp4", wire_id=7, options=("block_size", "stochastic", "generator"))
class FP4Codec(BlockCodec):
    bits = 4
    pad_code = 0
    invalid_codes = "0b1000, negative zero"
    bad_code = 8

    def quantize_rows(self, xb: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        # the 10-bit table key (sign, exponent, first mantissa bit) of x / s, then its code
        s = self.block_absmax(xb, scales)
        work = torch.mul(xb, (1.0 / s)[:, None])  # |work| <= 1
        if self.stochastic:
            self._stochastic_round(work)
        keys = torch.bitwise_right_shift(work.view(torch.int32).view(-1), 22)
        keys.bitwise_and_(0x3FF)
        torch.index_select(_tables(xb.device)[0], 0, keys, out=codes)

    def dequantize_rows(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        dec = _tables(codes.device)[1]
        torch.index_select(dec, 0, codes.to(torch.int32), out=out.view(-1))
        out.mul_(scales[:, None])
        return torch.bitwise_xor(codes, 8).amin() == 0

    def invalid(self, codes: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_xor(codes, 8).amin() == 0

    def triton_format(
        self, device: torch.device, decode: bool = False
    ) -> tuple[int, int, torch.Tensor | None]:
        return 0, 0, _tables(device)[1 if decode else 0]

    def _stochastic_round(self, y: torch.Tensor) -> None:
        """Replace y (|y| <= 1) in place by an unbiased random choice of its two neighbours."""
        a = y.abs()
        low = (a.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**floor(log2 a)
        small = a < 2.0**-6
        lower = torch.where(small, torch.zeros_like(a), low)
        upper = torch.where(small, torch.full_like(a, 2.0**-6), 2 * low)
        p_up = (a - lower) / (upper - lower)
        u = dither(a.numel(), self.generator, a.device).view(a.shape)
        q = torch.where(u < p_up, upper, lower).clamp_(max=1.0)
        torch.copysign(q, y, out=y)
