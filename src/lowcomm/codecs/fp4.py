"""FP4 E3M0: the Streaming DiLoCo 4-bit float (1 sign bit, 3 exponent bits, no mantissa).

Scaling (the paper leaves it open; our choice): one fp32 scale per block of ``block_size``
elements (default 256), the block's absmax ``s``. A 4-bit code is ``sign << 3 | e`` with
``e`` in 0..7: ``e = 0`` is zero, ``e >= 1`` is ``+-s * 2**(e - 7)``, so magnitudes
{0, s/64, s/32, ..., s/2, s} (the block max is exact). The code ``0b1000`` (negative zero) is
never produced and a decoder rejects it. Two codes per byte, planar (see bitpack); header and
scales as in ``_block``. Bits per element: ``4 + 32 / block_size``.

Rounding to nearest in linear terms: ``|x|/s`` goes to the nearest of the 8 magnitudes (ties
up), i.e. to the nearest power of two when ``|x| >= s/128`` and to zero below. Error per
element: ``|x - x'| <= max(|x| / 3, s / 128)``. With ``stochastic=True`` it rounds to one of the
two neighbouring magnitudes with probabilities that make it unbiased (``E[x'] = x``); error
``<= max(|x|, s / 64)``.

Speed trick: the top 10 bits of the fp32 pattern of ``x/s`` (sign, 8 exponent bits and the
first mantissa bit, which says whether the value is past 1.5x its power of two) determine the
nearest code, so encoding is a multiply, a shift, a mask and a table lookup -- done per pair
of codes in a 2**20-entry table that yields the packed byte directly.
"""

from __future__ import annotations

import math

import torch

from . import _native, _triton
from ._block import MIN_SCALE, BlockCodec, dither
from ._format import HEADER_BYTES, check_finite_scales, check_payload, numel_of
from .bitpack import PLANE_BYTES
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
# the packed byte of a (low, high) pair of 10-bit keys: index low * 1024 + high (1 MiB)
_PAIR = (_ENC.view(1024, 1).int() + 16 * _ENC.view(1, 1024).int()).to(torch.uint8).view(-1)
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if device not in _TABLES:
        _TABLES[device] = (_ENC.to(device), _DEC.to(device), _PAIR.to(device))
    return _TABLES[device]


@register("fp4", wire_id=7, options=("block_size", "stochastic", "generator"))
class FP4Codec(BlockCodec):
    bits = 4
    pad_code = 0
    invalid_codes = "0b1000, negative zero"

    def _keys(self, xb, scales, work, iwork) -> None:
        """iwork <- the 10-bit table key (sign, exponent, first mantissa bit) of x / s."""
        s = self._block_absmax(xb, work, scales)
        torch.mul(xb, (1.0 / s)[:, None], out=work)  # |work| <= 1
        if self.stochastic:
            self._stochastic_round(work)
        torch.bitwise_right_shift(work.view(torch.int32).view(-1), 22, out=iwork)
        iwork.bitwise_and_(0x3FF)

    def _quantize(self, xb, scales, work, iwork, codes):
        table = _tables(xb.device)[0]
        if not self.stochastic and _triton.quantize(xb, scales, codes, 0, 0, MIN_SCALE, table):
            return  # one pass on a GPU, the same bits
        self._keys(xb, scales, work, iwork)
        torch.index_select(_tables(xb.device)[0], 0, iwork, out=codes)

    def _quantize_packed(self, xb, scales, work, iwork, packed):
        if not self.stochastic and _triton.usable(xb.device):
            return False  # the fused _quantize, then the packing: fewer passes
        # whole planar groups: combine the keys of the two codes sharing a byte and look the
        # packed byte up at once (half the lookups, no separate packing pass)
        self._keys(xb, scales, work, iwork)
        keys = iwork.view(-1, 2, 256)
        pair = work.view(torch.int32).view(-1)[: packed.numel()]  # work is free again
        torch.add(keys[:, 1], keys[:, 0], alpha=1024, out=pair.view(-1, 256))
        torch.index_select(_tables(xb.device)[2], 0, pair, out=packed)
        return True

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

    def _encode_fused(self, flat, scales, packed) -> bool:
        kernels = None if self.stochastic else _native.usable(flat)
        if kernels is None:
            return False
        unit = math.lcm(2 * PLANE_BYTES, self.block_size)  # whole blocks and packing groups
        span = unit * max(1, (1 << 16) // unit)
        return not kernels.lc_fp4_encode(
            _native.ptr(flat),
            flat.numel(),
            self.block_size,
            span,
            MIN_SCALE,
            self.pad_code,
            _native.ptr(scales),
            _native.ptr(packed),
        )

    def decode_mean(self, payloads, shape, out, weights=None, divisor=1.0, names=None) -> bool:
        kernels = _native.usable(out)
        n = numel_of(shape)
        if kernels is None or not payloads or n == 0:
            return False
        _, codes_at, total = self._layout(n)
        packed, scales = [], []
        for w, payload in enumerate(payloads):
            name = names[w] if names else f"payload {w}"
            payload = check_payload(
                payload,
                name=name,
                codec=self.name,
                describe=self.describe(),
                expected_nbytes=total,
                param=self.block_size,
                numel=n,
                shape=shape,
            )
            sc = payload[HEADER_BYTES:codes_at].view(torch.float32)
            check_finite_scales(sc, name)
            packed.append(payload[codes_at:])
            scales.append(sc)
        if _native.usable(*packed, *scales) is None:
            return False
        w32 = torch.tensor(weights, dtype=torch.float32) if weights is not None else None
        bad = kernels.lc_fp4_decode_mean(
            len(payloads),
            _native.addresses(packed),
            _native.addresses(scales),
            None if w32 is None else _native.ptr(w32),
            divisor,
            n,
            self.block_size,
            _native.ptr(out),
        )
        return bad == 0  # invalid codes: the one-by-one decode names the payload

    def _dequantize(self, codes, scales, out, iwork):
        dec = _tables(codes.device)[1]
        bad = _triton.dequantize(codes, scales, out, 0, 0, dec)
        if bad is not None:  # one pass on a GPU, the same bits
            return bad
        iwork.copy_(codes)
        torch.index_select(dec, 0, iwork, out=out.view(-1))
        out.mul_(scales[:, None])
        torch.bitwise_xor(codes, 8, out=iwork.view(torch.uint8)[: codes.numel()])
        return iwork.view(torch.uint8)[: codes.numel()].amin() == 0
