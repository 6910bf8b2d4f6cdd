"""Lookup-table value codec: SparseLoCo's 2-bit quantization of the kept top-k values.

Per tensor (docs/algorithms.md §3 step 3, generalised from 2 to ``bits`` bits with ``L = 2**bits``):
``shift = mean(v)``, ``sigma = std(v)`` (unbiased, as ``torch.std``, computed on the values
scaled by their absmax so it neither overflows nor underflows; 0 for fewer than 2 values),
``width = 6 sigma / L`` (1 when sigma is 0), and each value gets
``code = clamp(round((v - shift) / width + L/2), 0, L-1)`` -- for 2 bits the reference code's
bins at -2..+1 widths. Each code decodes to ``shift + lut[code]`` with ``lut[c]`` the mean of
``v - shift`` over the values coded ``c`` (the bin centre ``(c - L/2) * width`` for an empty
bin). Error: every value decodes to the mean of its bin, so within its bin's range; interior
bins are ``width`` wide.

Wire format::

    header (16 bytes, parameter = bits)
    shift: fp32
    lut:   L x fp32
    codes: numel x ``bits`` bits (bitpack.pack_bits)

Element-wise in the sense the reduce needs (any 1-D slice is self-contained), though the
statistics are per encoded tensor. Bits per element: ``bits`` (+ ``32 (L + 1)`` per tensor).
"""

from __future__ import annotations

import torch

from . import _native
from ._format import (
    HEADER_BYTES,
    as_float_input,
    check_finite,
    check_payload,
    numel_of,
    write_header,
)
from .base import Codec
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .registry import register


@register("lut", wire_id=9, config=False)  # only as top-k's value codec
class LutCodec(Codec):
    def __init__(self, bits: int = 2) -> None:
        if not 1 <= bits <= 8:
            raise ValueError(f"lookup codec bits must be in 1..8, got {bits}")
        self.bits = bits
        self.levels = 2**bits

    def __repr__(self) -> str:
        return f"LutCodec(bits={self.bits})"

    def describe(self) -> str:
        return f"lut(bits={self.bits})"

    def _codes_at(self) -> int:
        return HEADER_BYTES + 4 * (1 + self.levels)

    def nbytes(self, shape: torch.Size) -> int:
        return self._codes_at() + packed_nbytes(numel_of(shape), self.bits)

    def formula_bits_per_param(self, shape: torch.Size) -> float:
        return float(self.bits)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        v = as_float_input(x)
        n = v.numel()
        dev = v.device
        L = self.levels
        payload = torch.empty(self.nbytes((n,)), dtype=torch.uint8, device=dev)
        write_header(payload, self.name, self.bits, n)
        stats = payload[HEADER_BYTES : self._codes_at()].view(torch.float32)  # shift, lut
        if n == 0:
            stats.zero_()
            return payload
        shift = v.mean()
        centred = v - shift
        # std of the values scaled to [-1, 1], scaled back: squares of 1e30 would overflow
        # fp32 (and squares of 1e-30 underflow) in a plain std
        m = centred.abs().amax()
        m = torch.where(m > 0, m, torch.ones((), device=dev))
        sigma = (centred / m).std() * m if n > 1 else torch.zeros((), device=dev)
        # sigma == 0: every value equals the mean; code L/2 decodes to shift + 0
        width = torch.where(sigma > 0, sigma * (6.0 / L), torch.ones((), device=dev))
        y = centred / width
        y.add_(L // 2).round_().clamp_(0, L - 1)
        codes = y.to(torch.uint8)
        idx = codes.to(torch.int64)
        # bin sums in float64: index_add_ adds one value after another, and over 10^4 values
        # in one bin a float32 running sum drifts by 1e-4 of the mean (found by test_codecs)
        sums = torch.zeros(L, dtype=torch.float64, device=dev).index_add_(0, idx, centred.double())
        counts = torch.bincount(idx, minlength=L).to(torch.float64)
        centres = (torch.arange(L, dtype=torch.float32, device=dev) - L // 2) * width
        lut = torch.where(counts > 0, (sums / counts.clamp(min=1)).float(), centres)
        stats[0] = shift
        stats[1:] = lut
        payload[self._codes_at() :] = pack_bits(codes, self.bits)
        return payload

    def decode(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> torch.Tensor:
        shape = torch.Size(shape)
        n = numel_of(shape)
        payload = check_payload(
            payload,
            name=name,
            codec=self.name,
            describe=self.describe(),
            expected_nbytes=self.nbytes(shape),
            param=self.bits,
            numel=n,
            shape=shape,
        )
        stats = payload[HEADER_BYTES : self._codes_at()].view(torch.float32)
        check_finite(stats, name, "shift or lookup table")
        # every bits-bit code indexes the table, so codes need no range check
        kernels = _native.usable(payload) if self.bits in (1, 2, 4, 8) else None
        if kernels is not None:  # unpacked and looked up in one pass (the same bits)
            out = torch.empty(n, dtype=torch.float32)
            lut = stats[1:].contiguous()
            kernels.lc_lut_decode(
                _native.ptr(payload[self._codes_at() :]),
                n,
                self.bits,
                _native.ptr(lut),
                float(stats[0]),
                _native.ptr(out),
            )
            return out.view(shape)
        codes = unpack_bits(payload[self._codes_at() :], self.bits, n)
        out = stats[1:].index_select(0, codes)
        out.add_(stats[0])
        return out.view(shape)
