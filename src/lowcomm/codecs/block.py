"""The block-scaled codecs (uniform int-k and FP4 E3M0): their wire format and their plan.

Wire format, per tensor::

    header (16 bytes, parameter = block size)
    scales: ceil(numel / block_size) x fp32, the absmax of each block of the flattened tensor
            (clamped below to 2**-100 so 1/scale never overflows); the last block may be short
    codes:  numel codes of ``bits`` bits, packed planar (bitpack.pack_planar)

The tensor is flattened in row-major order and cut into blocks of ``block_size`` elements (the
last one may be shorter), so any shape (0-d, 1-D, N-D) and any 1-D slice encodes the same way:
these codecs are element-wise. Scales are stored in fp32 rather than fp16: pseudo-gradients
routinely have block maxima below fp16's normal range (6e-5), and 32 bits per block of 256 cost
0.125 bit per element.

A :class:`BlockPlan` encodes and decodes a bucket of tensors at once, in kernel launches that
depend on the bucket's size and not on its number of tensors, with no host read:

- **Quantisation.** The blocks of every tensor (each tensor's last block may be short) form one
  ``blocks x B`` matrix, quantised a chunk of rows at a time (the chunk stays in a CPU's cache;
  on an accelerator it only bounds the temporaries) by the ``quantize`` kernel
  (:mod:`.kernels`). Where every tensor is a whole number of blocks the matrix is the input
  itself; else the blocks are gathered from it and a short block's missing entries read as
  zero (an absmax is not changed by a zero).
- **Packing.** Each tensor's codes are contiguous in that matrix. Their whole planar groups
  (``256 * per`` codes) are packed at once and copied to each tensor's place by one
  multi-tensor copy; each tensor's last, partial group goes through a small index built once.
- **Decode.** The inverse, with the decoder's checks as one device flag: the headers, finite
  non-negative scales, no invalid code. :meth:`BlockCodec.explain` says which tensor broke
  which rule, for the error.
"""

from __future__ import annotations

from typing import Any

import torch

from . import kernels
from ._format import (
    HEADER_BYTES,
    check_finite_scales,
    check_payload,
    chunk_elems,
    numel_of,
    set_headers,
)
from .base import Codec, PayloadError, Plan
from .bitpack import PLANE_BYTES, planar_nbytes, unpack_planar

#: smallest stored scale: blocks whose absmax is below it quantize relative to it instead
#: (an absolute error below 2**-100, far under anything a float32 model notices).
MIN_SCALE = 2.0**-100

DEFAULT_BLOCK_SIZE = 256


def dither(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``n`` uniform samples ``(v + 0.5) / 65536`` for v uniform in 0..65535, i.e. in (0, 1)
    with 16-bit resolution (mean exactly 1/2): four per 64-bit draw, cheaper than
    ``torch.rand``, which stochastic rounding is bound by."""
    words = torch.empty(-(-n // 4), dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # all 64 bits random
    u = words.view(torch.int16)[:n].to(torch.float32)  # -32768..32767
    return u.add_(32768.5).mul_(1.0 / 65536)


class BlockCodec(Codec):
    """Per-block absmax scale + ``bits``-bit codes. Subclasses give the format: a row of
    blocks' codes (:meth:`quantize_rows`) and back (:meth:`dequantize_rows`)."""

    elementwise = True
    bits: int = 8
    #: code written into the padding fields of the last byte
    pad_code: int = 0
    min_scale = MIN_SCALE
    #: human description of the codes a decoder rejects
    invalid_codes: str = ""
    #: the one code outside the format (what ``invalid`` looks for)
    bad_code: int = 0

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

    def __repr__(self) -> str:
        sr = ", stochastic=True" if self.stochastic else ""
        return f"{type(self).__name__}({self.name}, block_size={self.block_size}{sr})"

    def describe(self) -> str:
        return f"{self.name}(block_size={self.block_size})"

    # ---- sizes -------------------------------------------------------------------------------
    def _layout(self, n: int) -> tuple[int, int, int]:
        nblocks = -(-n // self.block_size)
        codes_at = HEADER_BYTES + 4 * nblocks
        return nblocks, codes_at, codes_at + planar_nbytes(n, self.bits)

    def nbytes(self, shape: torch.Size) -> int:
        return self._layout(numel_of(shape))[2]

    def formula_bits_per_param(self, shape: torch.Size) -> float:
        n = numel_of(shape)
        if n == 0:
            return self.bits + 32.0 / self.block_size
        return self.bits + 32.0 * (-(-n // self.block_size)) / n

    # ---- the format --------------------------------------------------------------------------
    def quantize_rows(self, xb: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        """xb (rows, B) FP32 -> scales (rows,) FP32 and codes (rows * B,) uint8, by torch: the
        reference of the ``quantize`` kernel."""
        raise NotImplementedError

    def dequantize_rows(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """codes (rows * B,) uint8, scales (rows,) -> out (rows, B) FP32, by torch; a 0-d bool,
        whether a code outside the format was read."""
        raise NotImplementedError

    def invalid(self, codes: torch.Tensor) -> torch.Tensor:
        """Whether ``codes`` (one a byte) hold one outside the format (a 0-d bool)."""
        rows = -(-codes.numel() // self.block_size)
        out = torch.empty(rows, self.block_size, device=codes.device)
        padded = torch.full((rows * self.block_size,), self.pad_code, dtype=torch.uint8)
        padded[: codes.numel()] = codes
        return self.dequantize_rows(
            padded.to(codes.device), torch.ones(rows, device=codes.device), out
        )

    def triton_format(
        self, device: torch.device, decode: bool = False
    ) -> tuple[int, int, torch.Tensor | None] | None:
        """(qmax, offset, table) for the Triton kernels: int-k's qmax and code offset, or
        (0, 0, FP4's table for ``device``: codes by key, or with ``decode`` values by code);
        None for a format they do not know (its torch steps run)."""
        return None

    def block_absmax(self, xb: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Each row's absmax (clamped below to MIN_SCALE) into ``scales``, returned: one read
        (its extremes), no temporary the size of ``xb`` (NaN stays NaN: the receiver's scale
        check catches it)."""
        s = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_())  # (faster than aminmax)
        s.clamp_(min=MIN_SCALE)
        scales.copy_(s)
        return s

    def _make_plan(
        self, shapes: list[torch.Size], device: torch.device, at: list[int] | None
    ) -> BlockPlan:
        return BlockPlan(self, shapes, device, at)

    # ---- checks, for the error ---------------------------------------------------------------
    def explain(self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor") -> None:
        """PayloadError saying what in ``payload`` (one tensor's) breaks the format, if it does."""
        n = numel_of(shape)
        B = self.block_size
        _, codes_at, total = self._layout(n)
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
        codes = (
            unpack_planar(payload[codes_at:], self.bits, n) if self.bits < 8 else payload[codes_at:]
        )
        rows = -(-n // B)
        padded = torch.full((rows * B,), self.pad_code, dtype=torch.uint8)
        padded[:n] = codes
        out = torch.empty(rows, B, dtype=torch.float32)
        if bool(self.dequantize_rows(padded, scales, out)):
            raise PayloadError(
                f"{name}: {self.describe()} payload holds codes outside the format's range "
                f"({self.invalid_codes})"
            )


class BlockPlan(Plan):
    """One bucket's shapes under one block codec, on one device (see the module doc)."""

    sparse = False
    negative_zeros = False  # a code's value is (code - offset) * s / qmax, or FP4's (no -0) * s

    def __init__(
        self,
        codec: BlockCodec,
        shapes: list[torch.Size],
        device: torch.device,
        at: list[int] | None = None,
    ) -> None:
        super().__init__(codec, shapes, device, at)
        self.kernels = kernels.choose(device, codec.kernels)
        B, bits = codec.block_size, codec.bits
        self.per = 8 // bits
        self.group = PLANE_BYTES * self.per
        blocks = [-(-n // B) for n in self.sizes]
        self.blocks = sum(blocks)
        self.aligned = all(n % B == 0 for n in self.sizes)
        set_headers(self, [B] * len(self.sizes))
        self.spans = []
        b0 = e0 = 0
        for n, nb, at0 in zip(self.sizes, blocks, self.at):
            codes_at = at0 + HEADER_BYTES + 4 * nb
            self.spans.append((n, nb, b0, e0, at0 + HEADER_BYTES, codes_at))
            b0, e0 = b0 + nb, e0 + n
        rows = max(1, chunk_elems(device) // B)
        self.chunk_rows = rows
        self._index(B, device)

    def _index(self, B: int, device: torch.device) -> None:
        """The small index tensors: each block's first element, the positions a short block
        pads and each tensor's partial planar group (its bytes, and the codes in each)."""
        starts, pads, tail_bytes, tail_codes = [], [], [], []
        self.full_groups = 0
        for n, nb, b0, e0, _, codes_at in self.spans:
            starts += [e0 + j * B for j in range(nb)]
            pads += range(b0 * B + n, (b0 + nb) * B)
            full = n // self.group if self.per > 1 else 0
            self.full_groups += full
            rest = n - full * self.group if self.per > 1 else 0
            if rest:  # pack_planar's partial group: code j in byte j % nb, field j // nb
                nbt = -(-rest // self.per)
                base = b0 * B + full * self.group
                for j in range(nbt):
                    tail_bytes.append(codes_at + full * PLANE_BYTES + j)
                    tail_codes.append(
                        [base + j + p * nbt if j + p * nbt < rest else -1 for p in range(self.per)]
                    )
        # each tensor's (first code in the block-laid codes, codes, first packed byte): the
        # runs the C pack and unpack walk
        runs = [(b0 * B, n, codes_at) for n, _, b0, _, _, codes_at in self.spans]
        cols = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3).t().contiguous()
        self.runs = tuple(cols.to(device))
        # each tensor's (first value among the tensors, values, first block row): the runs the
        # C quantisation and dequantisation walk
        values = [(e0, n, b0) for n, _, b0, e0, _, _ in self.spans]
        cols = torch.tensor(values, dtype=torch.int64).reshape(-1, 3).t().contiguous()
        self.value_runs = tuple(cols.to(device))
        self.block_start = _ints(starts, device)
        self.pad_at = _ints(pads, device)
        self.tail_bytes = _ints(tail_bytes, device)
        tail = torch.tensor(tail_codes, dtype=torch.int64).view(-1, self.per)
        self.tail_codes = tail.to(device)
        # the fields that hold a code, as flat positions among the tail bytes' fields, and the
        # codes they hold (an index worked out once: a mask would read the device at each use)
        used = (tail >= 0).view(-1).nonzero().view(-1)
        self.tail_used, self.tail_dest = used.to(device), tail.view(-1)[used].to(device)

    # ---- encode ------------------------------------------------------------------------------
    def encode(
        self, flat: torch.Tensor, out: torch.Tensor, decoded: bool = False
    ) -> tuple[None, torch.Tensor | None]:
        """Encode ``flat`` (the tensors, FP32, one after another) into ``out`` at the plan's
        places; with ``decoded``, also what peers decode of it (the tensors one after another,
        FP32), from the codes just made."""
        B, dev = self.codec.block_size, flat.device
        out[self.header_at] = self.header_want
        if self.blocks == 0:  # empty tensors only: their headers are all there is
            return None, torch.zeros(0, device=dev) if decoded else None
        scales = torch.empty(self.blocks, dtype=torch.float32, device=dev)
        codes = torch.empty(self.blocks * B, dtype=torch.uint8, device=dev)
        self.kernels.quantize(self, flat.contiguous(), scales, codes)
        _copy(self._scale_views(out), self._scale_views_of(scales))
        values = self._dequantized(codes, scales)[0] if decoded else None
        if self.per == 1:
            _copy(self._code_views(out), self._codes_of(codes))
            return None, values
        self.kernels.pack(self, codes, out)
        return None, values

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """The blocks of every tensor as rows of ``B`` (short blocks padded with zeros): the
        input itself where every tensor is whole blocks, else each tensor copied to its first
        block by one multi-tensor copy."""
        B = self.codec.block_size
        if self.aligned:
            return flat.view(self.blocks, B)
        rows = torch.empty(self.blocks * B, dtype=torch.float32, device=flat.device)
        _copy(self._padded_views(rows), self._flat_views(flat))
        rows[self.pad_at] = 0.0
        return rows.view(self.blocks, B)

    def _padded_views(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's values in a block-laid buffer."""
        B = self.codec.block_size
        return [blocks[b0 * B : b0 * B + n] for n, _, b0, _, _, _ in self.spans]

    def _flat_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's values among the tensors one after another."""
        return [flat[e0 : e0 + n] for n, _, _, e0, _, _ in self.spans]

    def pack_groups(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Every tensor's codes packed planar into ``out`` (as pack_planar does), by torch: the
        ``pack`` kernel's reference."""
        per, bits = self.per, self.codec.bits
        staged = torch.empty(self.full_groups * self.group, dtype=torch.uint8, device=codes.device)
        _copy(self._group_views(staged, self.group), self._full_codes(codes))
        groups = staged.view(-1, per, PLANE_BYTES)
        packed = groups[:, 0].clone()
        for p in range(1, per):  # fields do not overlap: add == or
            packed.add_(groups[:, p], alpha=1 << (bits * p))
        _copy(self._code_views(out), self._group_views(packed.view(-1), PLANE_BYTES))
        if self.tail_bytes.numel():  # (codes of -1: the padding's)
            fields = codes[self.tail_codes.clamp(min=0)]
            fields = torch.where(self.tail_codes >= 0, fields, self.codec.pad_code)
            shifts = torch.arange(per, device=codes.device) * bits
            out[self.tail_bytes] = (fields.to(torch.int32) << shifts).sum(dim=1).to(torch.uint8)

    def _group_views(self, buf: torch.Tensor, per_group: int) -> list[torch.Tensor]:
        """Each tensor's run of whole groups in ``buf`` (``per_group`` entries a group)."""
        out, at = [], 0
        for n, *_ in self.spans:
            size = (n // self.group) * per_group
            out.append(buf[at : at + size])
            at += size
        return out

    def _full_codes(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's codes of its whole groups in the block-laid ``codes``."""
        B = self.codec.block_size
        return [
            codes[b0 * B : b0 * B + (n // self.group) * self.group] for n, _, b0, *_ in self.spans
        ]

    # ---- decode ------------------------------------------------------------------------------
    def decode(
        self, payload: torch.Tensor, into: torch.Tensor | None = None, add: bool = False
    ) -> tuple[None, torch.Tensor, torch.Tensor]:
        """(None, the FP32 values of every tensor one after another, a 0-d bool: whether the
        payload breaks a rule of the format) of ``payload`` read at the plan's places, with no
        host read. ``into``: an FP32 buffer of ``numel`` the values are written into, or with
        ``add`` added to (returned as the values)."""
        if self.per > 1:  # packed codes: dequantised where they lie
            bad, scales = self._read_scales(payload)
            if scales is not None:
                values = (
                    into if into is not None else torch.empty(self.numel, device=payload.device)
                )
                invalid = self.kernels.decode_packed(
                    self, payload, scales, values, into is not None and add
                )
                return None, values, bad | invalid
        else:
            bad, scales, codes = self._read(payload)
        if scales is None:  # empty tensors only: their headers are all there is
            values = torch.zeros(0, device=payload.device)
            return None, values if into is None else into, bad
        values, invalid = self._dequantized(codes, scales, into, add)
        return None, values, bad | invalid

    def unpacked(self, payload: torch.Tensor) -> torch.Tensor:
        """The block-laid codes of ``payload`` (a short block's missing codes: padding)."""
        codes = self._read(payload)[2]
        assert codes is not None
        return codes

    def check(self, payload: torch.Tensor) -> torch.Tensor:
        """Whether ``payload`` breaks a rule of the format (a 0-d bool): :meth:`decode`'s flag,
        without the values (the codes scanned where they lie)."""
        bad, scales = self._read_scales(payload)
        return bad if scales is None else bad | self.kernels.scan(self, payload)

    def codes_bad(self, payload: torch.Tensor) -> torch.Tensor:
        """Whether ``payload``'s codes hold one outside the format (a 0-d bool), unpacked (the
        ``scan`` kernel's reference)."""
        codes = self._read(payload, kernels.unpack_torch)[2]
        if codes is None:
            return torch.zeros((), dtype=torch.bool, device=payload.device)
        return self.codec.invalid(codes)

    def _read_scales(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whether the headers or scales break the format, and the scales (None for empty
        tensors only)."""
        bad = self.headers_bad(payload)
        if self.blocks == 0:
            return bad, None
        scales = torch.empty(self.blocks, dtype=torch.float32, device=payload.device)
        _copy(self._scale_views_of(scales), self._scale_views(payload))
        return bad | ~(torch.isfinite(scales) & (scales >= 0)).all(), scales

    def _read(
        self, payload: torch.Tensor, unpack: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Whether the headers or scales break the format, the scales and the block-laid codes
        (a short block's missing codes: padding); None, None for empty tensors only.
        ``unpack``: the implementation (else the plan's kernel)."""
        codec, B, dev = self.codec, self.codec.block_size, payload.device
        bad, scales = self._read_scales(payload)
        if scales is None:
            return bad, None, None
        codes = torch.empty(self.blocks * B, dtype=torch.uint8, device=dev)
        codes[self.pad_at] = codec.pad_code
        if self.per == 1:
            _copy(self._codes_of(codes), self._code_views(payload))
        else:
            (unpack or self.kernels.unpack)(self, payload, codes)
        return bad, scales, codes

    def _dequantized(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        into: torch.Tensor | None = None,
        add: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The values of block-laid ``codes`` (the tensors one after another; into ``into``,
        or added to it) and whether a code outside the format was read."""
        values = into if into is not None else torch.empty(self.numel, device=codes.device)
        bad = self.kernels.dequantize(self, codes, scales, values, into is not None and add)
        return values, bad

    def quantize_torch(self, flat: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
        """Every tensor's blocks quantised by the codec's torch steps, a chunk of rows at a
        time (the ``quantize`` kernel's reference)."""
        B, xb = self.codec.block_size, self._blocks(flat)
        for r0 in range(0, self.blocks, self.chunk_rows):
            r1 = min(self.blocks, r0 + self.chunk_rows)
            self.codec.quantize_rows(xb[r0:r1], scales[r0:r1], codes[r0 * B : r1 * B])

    def dequantize_torch(
        self, codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, add: bool
    ) -> torch.Tensor:
        """Every tensor's values into ``values`` (or added to it) by the codec's torch steps (the
        ``dequantize`` kernel's reference); whether a code outside the format was read."""
        B, dev = self.codec.block_size, codes.device
        direct = self.aligned and not add
        out = values.view(self.blocks, B) if direct else torch.empty(self.blocks, B, device=dev)
        bad = torch.zeros((), dtype=torch.bool, device=dev)
        for r0 in range(0, self.blocks, self.chunk_rows):
            r1 = min(self.blocks, r0 + self.chunk_rows)
            bad |= self.codec.dequantize_rows(codes[r0 * B : r1 * B], scales[r0:r1], out[r0:r1])
        if not direct:
            self.unpad(out, values, add)
        return bad

    def unpad(self, blocks: torch.Tensor, values: torch.Tensor, add: bool) -> None:
        """Each tensor's values from block-laid ``blocks`` (rows of B, a short block's padding
        left out) into ``values`` (or added to it), in one multi-tensor op."""
        pieces = [
            (a, b)
            for a, b in zip(self._flat_views(values), self._padded_views(blocks.view(-1)))
            if a.numel()
        ]
        if pieces:
            targets, sources = [a for a, _ in pieces], [b for _, b in pieces]
            if add:
                torch._foreach_add_(targets, sources)
            else:
                torch._foreach_copy_(targets, sources)

    def unpack_groups(self, payload: torch.Tensor, codes: torch.Tensor) -> None:
        """Every tensor's codes from its packed bytes into ``codes`` (laid out by blocks), by
        torch: the ``unpack`` kernel's reference."""
        per, bits, dev = self.per, self.codec.bits, payload.device
        mask = (1 << bits) - 1
        packed = torch.empty(self.full_groups, PLANE_BYTES, dtype=torch.uint8, device=dev)
        _copy(self._group_views(packed.view(-1), PLANE_BYTES), self._code_views(payload))
        fields = torch.stack([(packed >> (bits * p)) & mask for p in range(per)], dim=1)
        _copy(self._full_codes(codes), self._group_views(fields.view(-1), self.group))
        if self.tail_bytes.numel():
            byte = payload[self.tail_bytes].to(torch.int32)[:, None]
            tail = (byte >> (torch.arange(per, device=dev) * bits)) & mask
            codes[self.tail_dest] = tail.view(-1)[self.tail_used].to(torch.uint8)

    # ---- views of a payload and of the plan's buffers, one per tensor ------------------------
    def _scale_views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        return [payload[s : s + 4 * nb] for _, nb, _, _, s, _ in self.spans]

    def _scale_views_of(self, scales: torch.Tensor) -> list[torch.Tensor]:
        raw = scales.view(torch.uint8)
        return [raw[4 * b0 : 4 * (b0 + nb)] for _, nb, b0, _, _, _ in self.spans]

    def _code_views(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's packed bytes in ``payload`` (for packed codecs: its whole groups)."""
        if self.per == 1:
            return [payload[c : c + n] for n, _, _, _, _, c in self.spans]
        return [payload[c : c + (n // self.group) * PLANE_BYTES] for n, *_, c in self.spans]

    def _codes_of(self, codes: torch.Tensor) -> list[torch.Tensor]:
        B = self.codec.block_size
        return [codes[b0 * B : b0 * B + n] for n, _, b0, _, _, _ in self.spans]


def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target, empty ones left out, as multi-tensor kernels."""
    pairs = [(t, s) for t, s in zip(targets, sources) if t.numel()]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)
