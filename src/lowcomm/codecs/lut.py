"""Lookup-table value codec: SparseLoCo's 2-bit quantization of the kept top-k values.

Per tensor (docs/algorithms.md §3 step 3, generalised from 2 to ``bits`` bits with ``L = 2**bits``):
``shift = mean(v)``, ``sigma = std(v)`` (unbiased, as ``torch.std``, computed on the values
scaled by their absmax so it neither overflows nor underflows; 0 for fewer than 2 values),
``width = 6 sigma / L`` (1 when sigma is 0), and each value gets
``code = clamp(round((v - shift) / width + L/2), 0, L-1)`` -- for 2 bits the reference code's
bins at -2..+1 widths. Each code decodes to ``shift + lut[code]`` with ``lut[c]`` the mean of
``v - shift`` over the values coded ``c`` (the bin centre ``(c - L/2) * width`` for an empty
bin). Error: every value decodes to the mean of its bin, so within its bin's range; interior
bins are ``width`` wide. The sums behind the mean, the std and the bins' means are float64
segment sums, each vector's (or bin's) own: a vector's statistics do not depend on what else
its bucket holds. They are stored in fp32.

Wire format::

    header (16 bytes, parameter = bits)
    shift: fp32
    lut:   L x fp32
    codes: numel x ``bits`` bits (bitpack.pack_planar)

Element-wise in the sense the reduce needs (any 1-D slice is self-contained), though the
statistics are per encoded tensor. Bits per element: ``bits`` (+ ``32 (L + 1)`` per tensor).
"""

from __future__ import annotations

import torch

from ..segments import Segments
from . import kernels
from ._format import HEADER_BYTES, check_finite, check_payload, numel_of, set_headers
from .base import Codec, Plan, written
from .bitpack import Stream, Streams, packed_nbytes
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

    def codes_at(self) -> int:
        """Where a payload's codes start: after the header, the shift and the table."""
        return HEADER_BYTES + 4 * (1 + self.levels)

    def nbytes(self, shape: torch.Size) -> int:
        return self.codes_at() + packed_nbytes(numel_of(shape), self.bits)

    def formula_bits_per_param(self, shape: torch.Size) -> float:
        return float(self.bits)

    def _make_plan(
        self, shapes: list[torch.Size], device: torch.device, at: list[int] | None
    ) -> LutPlan:
        return LutPlan(self, shapes, device, at)

    def explain(self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor") -> None:
        payload = check_payload(
            payload,
            name=name,
            codec=self.name,
            describe=self.describe(),
            expected_nbytes=self.nbytes(shape),
            param=self.bits,
            numel=numel_of(shape),
            shape=shape,
        )
        check_finite(payload[HEADER_BYTES : self.codes_at()].view(torch.float32), name,
                     "shift or lookup table")  # fmt: skip


class LutPlan(Plan):
    """A bucket of value vectors under one lookup codec: each vector's statistics (its shift
    and table) from segment sums over the bucket, every code packed by one set of streams."""

    def __init__(
        self,
        codec: LutCodec,
        shapes: list[torch.Size],
        device: torch.device,
        at: list[int] | None = None,
    ) -> None:
        super().__init__(codec, shapes, device, at)
        L = self.levels = codec.levels
        set_headers(self, [codec.bits] * len(self.sizes))
        stats_at, streams = [], []
        for a, s, n in zip(self.at, self.starts, self.sizes):
            stats_at.append(torch.arange(a + HEADER_BYTES, a + codec.codes_at()))
            streams.append(Stream(s, n, codec.bits, a + codec.codes_at()))
        self.stats_at = _cat(stats_at, device)
        self.codes = Streams(streams, device)
        self.kernels = kernels.choose(device, codec.kernels)
        self.tensors = len(self.shapes)
        sizes = torch.tensor(self.sizes, dtype=torch.int64)
        self.count = sizes.to(device)
        self.segments = Segments(self.sizes, device)
        self.seg = torch.repeat_interleave(
            torch.arange(self.tensors), sizes, output_size=self.numel
        ).to(device)
        self.centres = torch.arange(L, device=device) - L // 2

    def encode(
        self, flat: torch.Tensor, out: torch.Tensor, decoded: bool = False
    ) -> tuple[None, torch.Tensor]:
        """Encode the values ``flat`` into ``out``; returns what peers decode of them."""
        codes, stats, values = self.table(flat)
        out[self.header_at] = self.header_want
        out[self.stats_at] = stats.reshape(-1).view(torch.uint8)
        self.codes.pack(codes, out, out.numel() - 1, self.kernels)
        return None, values

    def table(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes, each vector's statistics (T x (1 + levels): shift, table) and the decoded
        values of ``v`` (see the module doc), with no host read. Every sum is a vector's own
        segment, so a vector holding a NaN poisons only its own statistics (its receivers
        refuse that table)."""
        L, segs, dev = self.levels, self.segments, v.device
        each = segs.spread  # a value per vector over its entries
        n = self.count.double()
        shift = (segs.sum(v.double()) / n.clamp(min=1)).float()
        centred = v - each(shift)
        m = segs.max(centred.abs())
        m = torch.where(m > 0, m, 1.0)  # std of the values scaled to [-1, 1], scaled back
        y = (centred / each(m)).double()
        dev2 = (y - each(segs.sum(y) / n.clamp(min=1))).square()
        sigma = torch.where(n > 1, (segs.sum(dev2) / (n - 1).clamp(min=1)).sqrt(), 0.0)
        sigma = sigma.float() * m
        width = torch.where(sigma > 0, sigma * (6.0 / L), 1.0)
        y32 = centred / each(width)
        # a NaN (a vector holding one: its shift is NaN) codes as 0, as a cast to uint8 leaves
        # it; receivers refuse its NaN table either way
        codes = y32.add_(L // 2).round_().clamp_(0, L - 1).to(torch.int64).clamp_(0, L - 1)
        sums, counts = self._bins(codes, centred.double(), dev)
        centres = self.centres * width[:, None]
        lut = torch.where(counts > 0, (sums / counts.clamp(min=1)).float(), centres)
        stats = torch.cat([shift[:, None], lut], dim=1)
        stats = torch.where(self.count[:, None] > 0, stats, 0.0)  # an empty vector's: zeros
        decoded = lut.view(-1)[self.seg * L + codes] + each(shift)
        return codes, stats, decoded

    def _bins(
        self, codes: torch.Tensor, centred: torch.Tensor, dev: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each vector's sum of ``centred`` (float64) and count per code: [T, levels] each. A
        few codes: one masked segment sum per code; many: the values sorted by (vector, code)
        and summed per run (each run in order either way: the same bits on every device)."""
        L, segs = self.levels, self.segments
        if L <= 16:
            hit = [codes == c for c in range(L)]
            sums = torch.stack([segs.sum(torch.where(h, centred, 0.0)) for h in hit], dim=1)
            counts = torch.stack([segs.sum(h.double()) for h in hit], dim=1)
            return sums, counts
        bins = self.seg * L + codes
        count = torch.zeros(self.tensors * L, dtype=torch.int64, device=dev)
        count.index_add_(0, bins, torch.ones_like(bins))  # whole numbers: exact in any order
        order = torch.argsort(bins, stable=True)
        sums = Segments(count, dev).sum(centred[order])
        return sums.view(-1, L), count.view(-1, L).double()

    def decode(
        self, payload: torch.Tensor, into: torch.Tensor | None = None, add: bool = False
    ) -> tuple[None, torch.Tensor, torch.Tensor]:
        bad = self.headers_bad(payload)
        stats = payload[self.stats_at].view(torch.float32).view(self.tensors, 1 + self.levels)
        bad |= ~torch.isfinite(stats).all()
        codes = self.codes.unpack(payload, self.numel, self.kernels)
        seg = self.seg
        values = stats[:, 1:].reshape(-1)[seg * self.levels + codes] + stats[:, 0][seg]
        return None, written(values, into, add), bad


def _cat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)).to(device)
