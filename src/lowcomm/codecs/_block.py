"""Shared machinery of the block-scaled codecs (uniform int-k and FP4 E3M0).

Wire format::

    header (16 bytes, parameter = block size)
    scales: ceil(numel / block_size) x fp32, the absmax of each block of the flattened tensor
            (clamped below to 2**-100 so 1/scale never overflows); the last block may be short
    codes:  numel codes of ``bits`` bits, packed planar (bitpack.pack_planar)

The tensor is flattened in row-major order and cut into blocks of ``block_size`` elements (the
last one may be shorter), so any shape (0-d, 1-D, N-D) and any 1-D slice encodes the same way:
these codecs are element-wise. Scales are stored in fp32 rather than fp16: pseudo-gradients
routinely have block maxima below fp16's normal range (6e-5), and 32 bits per block of 256 cost
0.125 bit per element.

Encode and decode run over chunks of ``_format.CPU_CHUNK`` elements with reused buffers, so the
temporaries stay in cache; each chunk is a handful of whole-tensor torch ops.
"""

from __future__ import annotations

import math

import torch

from ._format import (
    HEADER_BYTES,
    as_float_input,
    check_finite_scales,
    check_payload,
    chunk_elems,
    numel_of,
    write_header,
)
from .base import Codec, PayloadError
from .bitpack import PLANE_BYTES, pack_planar, planar_nbytes, unpack_planar
from .block_many import BlockPlan

#: smallest stored scale: blocks whose absmax is below it quantize relative to it instead
#: (an absolute error below 2**-100, far under anything a float32 model notices).
MIN_SCALE = 2.0**-100

DEFAULT_BLOCK_SIZE = 256


def dither(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``n`` uniform samples ``(v + 0.5) / 65536`` for v uniform in 0..65535, i.e. in (0, 1)
    with 16-bit resolution (mean exactly 1/2): four per 64-bit draw, about 3x cheaper than
    ``torch.rand`` on a CPU, which stochastic rounding is bound by."""
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # all 64 bits random
    u = words.view(torch.int16)[:n].to(torch.float32)  # -32768..32767
    return u.add_(32768.5).mul_(1.0 / 65536)


class BlockCodec(Codec):
    """Per-block absmax scale + ``bits``-bit codes. Subclasses quantize and dequantize a chunk."""

    elementwise = True
    bits: int = 8
    #: code written into the padding fields of the last byte
    pad_code: int = 0

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        stochastic: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1 or block_size >= 2**31:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.stochastic = bool(stochastic)
        self.generator = generator
        self.per_byte = 8 // self.bits
        self._group = PLANE_BYTES * self.per_byte if self.bits < 8 else PLANE_BYTES
        self._unit = math.lcm(block_size, self._group)
        self._plans: dict[tuple, BlockPlan] = {}  # plan() caches one per (shapes, device)

    def __repr__(self) -> str:
        sr = ", stochastic=True" if self.stochastic else ""
        return f"{type(self).__name__}({self.name}, block_size={self.block_size}{sr})"

    def describe(self) -> str:
        return f"{self.name}(block_size={self.block_size})"

    # ---- sizes -------------------------------------------------------------------------------
    def _layout(self, n: int) -> tuple[int, int, int]:
        nblocks = -(-n // self.block_size)
        scales_at = HEADER_BYTES
        codes_at = scales_at + 4 * nblocks
        return nblocks, codes_at, codes_at + planar_nbytes(n, self.bits)

    def nbytes(self, shape: torch.Size) -> int:
        return self._layout(numel_of(shape))[2]

    def formula_bits_per_param(self, shape: torch.Size) -> float:
        n = numel_of(shape)
        if n == 0:
            return self.bits + 32.0 / self.block_size
        return self.bits + 32.0 * (-(-n // self.block_size)) / n

    def _chunk(self, device: torch.device) -> int:
        return self._unit * max(1, chunk_elems(device) // self._unit)

    # ---- subclass hooks ----------------------------------------------------------------------
    def _quantize(
        self,
        xb: torch.Tensor,
        scales: torch.Tensor,
        work: torch.Tensor,
        iwork: torch.Tensor,
        codes: torch.Tensor,
    ) -> None:
        """xb (nb, B) fp32 -> scales (nb,) fp32 and codes (nb*B,) uint8. work/iwork: scratch."""
        raise NotImplementedError

    def _quantize_packed(
        self,
        xb: torch.Tensor,
        scales: torch.Tensor,
        work: torch.Tensor,
        iwork: torch.Tensor,
        packed: torch.Tensor,
    ) -> bool:
        """Optional fast path for whole packing groups: write packed bytes; False if absent."""
        return False

    def _dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, iwork: torch.Tensor
    ) -> torch.Tensor:
        """codes (nb*B,) uint8, scales (nb,) -> out (nb, B) fp32; return a 0-d bool 'invalid'."""
        raise NotImplementedError

    def _block_absmax(
        self, xb: torch.Tensor, work: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        if xb.device.type == "cpu":  # the chunk stays in cache: two cheap passes
            torch.abs(xb, out=work)
            s = work.amax(dim=1)
        else:  # one read, no model-sized write (the same maxima)
            s = torch.linalg.vector_norm(xb, ord=float("inf"), dim=1)
        s.clamp_(min=MIN_SCALE)  # NaN stays NaN: the receiver's scale check catches it
        scales.copy_(s)
        return s

    # ---- encode / decode ---------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        flat = as_float_input(x)
        n = flat.numel()
        B = self.block_size
        nblocks, codes_at, total = self._layout(n)
        dev = flat.device
        payload = torch.empty(total, dtype=torch.uint8, device=dev)
        write_header(payload, self.name, B, n)
        scales = payload[HEADER_BYTES:codes_at].view(torch.float32)
        packed = payload[codes_at:]
        if n and self._encode_fused(flat, scales, packed):
            return payload
        ch = self._chunk(dev)  # a multiple of the block size and of the packing group
        size = max(1, min(ch, n))
        work = torch.empty(size, dtype=torch.float32, device=dev)
        iwork = torch.empty(size, dtype=torch.int32, device=dev)
        codes = torch.empty(size, dtype=torch.uint8, device=dev)
        for start in range(0, n, ch):
            m = min(ch, n - start)
            full, tail = divmod(m, B)  # only the very last block may be short
            xc = flat[start : start + m]
            b0 = start // B
            p0 = start // self.per_byte
            if not tail:
                xb, sb, wb = xc.view(full, B), scales[b0 : b0 + full], work[:m].view(full, B)
                if self.bits == 8:  # one code per byte: write straight to the wire
                    self._quantize(xb, sb, wb, iwork[:m], packed[p0 : p0 + m])
                    continue
                if m % self._group == 0 and self._quantize_packed(
                    xb, sb, wb, iwork[:m], packed[p0 : p0 + m // self.per_byte]
                ):
                    continue
            fb = full * B
            if full:
                self._quantize(
                    xc[:fb].view(full, B),
                    scales[b0 : b0 + full],
                    work[:fb].view(full, B),
                    iwork[:fb],
                    codes[:fb],
                )
            if tail:
                self._quantize(
                    xc[fb:].view(1, tail),
                    scales[b0 + full : b0 + full + 1],
                    work[:tail].view(1, tail),
                    iwork[:tail],
                    codes[fb:m],
                )
            pack_planar(
                codes[:m],
                self.bits,
                out=packed[p0 : p0 + planar_nbytes(m, self.bits)],
                pad=self.pad_code,
            )
        return payload

    def decode(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> torch.Tensor:
        shape = torch.Size(shape)
        n = numel_of(shape)
        B = self.block_size
        nblocks, codes_at, total = self._layout(n)
        payload = check_payload(
            payload,
            name=name,
            codec=self.name,
            describe=self.describe(),
            expected_nbytes=total,
            param=B,
            numel=n,
            shape=shape,
        )
        scales = payload[HEADER_BYTES:codes_at].view(torch.float32)
        check_finite_scales(scales, name)
        packed = payload[codes_at:]
        dev = payload.device
        out = torch.empty(n, dtype=torch.float32, device=dev)
        ch = self._chunk(dev)
        size = max(1, min(ch, n))
        codes = torch.empty(size, dtype=torch.uint8, device=dev)
        iwork = torch.empty(size, dtype=torch.int32, device=dev)
        invalid = torch.zeros((), dtype=torch.bool, device=dev)
        for start in range(0, n, ch):
            m = min(ch, n - start)
            full, tail = divmod(m, B)
            fb = full * B
            p0 = start // self.per_byte
            b0 = start // B
            if self.bits == 8:  # codes are the wire bytes themselves
                cm = packed[p0 : p0 + m]
            else:
                cm = unpack_planar(
                    packed[p0 : p0 + planar_nbytes(m, self.bits)], self.bits, m, out=codes[:m]
                )
            if full:
                invalid |= self._dequantize(
                    cm[:fb],
                    scales[b0 : b0 + full],
                    out[start : start + fb].view(full, B),
                    iwork[:fb],
                )
            if tail:
                invalid |= self._dequantize(
                    cm[fb:],
                    scales[b0 + full : b0 + full + 1],
                    out[start + fb : start + m].view(1, tail),
                    iwork[:tail],
                )
        if bool(invalid):
            raise PayloadError(
                f"{name}: {self.describe()} payload holds codes outside the "
                f"format's range ({self.invalid_codes})"
            )
        return out.view(shape)

    def plan(self, shapes: list[torch.Size], device: torch.device) -> BlockPlan | None:
        """The plan that encodes and decodes tensors of ``shapes`` together on ``device``
        (cached; :mod:`.block_many`), or None with stochastic rounding (its draws would fall
        otherwise)."""
        if self.stochastic:
            return None
        key = (tuple(tuple(s) for s in shapes), device)
        if key not in self._plans:
            self._plans[key] = BlockPlan(self, [torch.Size(s) for s in shapes], device)
        return self._plans[key]

    def _encode_fused(self, flat: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor) -> bool:
        """Optional: encode all of ``flat`` with a fused kernel, the same bits as the chunked
        torch path below; False if not done."""
        return False

    def decode_mean(
        self,
        payloads: list[torch.Tensor],
        shape: torch.Size,
        out: torch.Tensor,
        weights: list[float] | None = None,
        divisor: float = 1.0,
        names: list[str] | None = None,
    ) -> bool:
        """``out`` (flat FP32) = the decoded payloads (each times its weight) summed from zero
        and divided by ``divisor``, in one pass: the same bits as doing that with
        :meth:`decode` results. False where no fused kernel does it (``out`` unspecified:
        decode the payloads one by one)."""
        return False

    #: human description of the codes a decoder rejects
    invalid_codes: str = ""
