"""A block-scaled codec (int8, int4, int2, fp4) over many tensors at once: the bytes its
per-tensor encode writes for each tensor in turn, and its checked decode, in kernel launches
that depend on the tensors' total size and not on their count, with no host synchronisation
(an accelerator's path; the per-tensor codec launched a dozen kernels and read the device three
times per tensor and payload, a Streaming fragment's decode 34 ms on an H200).

- **Quantisation.** The blocks of every tensor (each tensor's last block may be short) form one
  ``blocks x B`` matrix, quantised by the codec's own chunk step: the same scales and codes.
  Where every tensor is a whole number of blocks, the matrix is the input itself; else the
  blocks are gathered from it and a short block's missing entries read as zero (an absmax is
  not changed by a zero).
- **Packing.** Each tensor's codes are contiguous in that matrix. Their whole planar groups
  (``256 * per`` codes) are packed at once and copied to each tensor's place by one
  multi-tensor copy; each tensor's last, partial group goes through a small index built once.
- **Decode.** The inverse, with the per-tensor decode's checks as one device flag: the headers,
  finite non-negative scales, no invalid code. A caller that finds it set decodes tensor by
  tensor, which names the fault.

A plan is built once per (shapes, device) and cached by the codec (:meth:`.BlockCodec.plan`).
"""

from __future__ import annotations

import torch

from ._format import HEADER_BYTES, write_header
from .bitpack import PLANE_BYTES, planar_nbytes


class BlockPlan:
    """One bucket's shapes under one block codec, on one device: :meth:`encode` and
    :meth:`decode` of all of them at once. ``sparse`` is False: decodes are dense."""

    sparse = False

    def __init__(self, codec, shapes: list[torch.Size], device: torch.device) -> None:
        self.codec, self.device = codec, device
        B, bits = codec.block_size, codec.bits
        self.per = 8 // bits
        self.group = PLANE_BYTES * self.per
        sizes = [torch.Size(s).numel() for s in shapes]
        self.numel = sum(sizes)
        self.nbytes = sum(codec.nbytes(s) for s in shapes)
        blocks = [-(-n // B) for n in sizes]
        self.blocks = sum(blocks)
        self.aligned = all(n % B == 0 for n in sizes)
        template = torch.zeros(self.nbytes, dtype=torch.uint8)
        headers, self.spans = [], []
        at = b0 = e0 = 0
        for n, nb in zip(sizes, blocks):
            write_header(template[at : at + HEADER_BYTES], codec.name, B, n)
            headers.append(torch.arange(at, at + HEADER_BYTES))
            codes_at = at + HEADER_BYTES + 4 * nb
            self.spans.append((n, nb, b0, e0, at + HEADER_BYTES, codes_at))
            at = codes_at + planar_nbytes(n, bits)
            b0, e0 = b0 + nb, e0 + n
        self.header_at = torch.cat(headers).to(device) if headers else _ints([], device)
        self.header_want = template.to(device)[self.header_at]
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
    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> tuple[None, None]:
        """Encode ``flat`` (the tensors, FP32, one after another) into ``out`` (``nbytes + 1``
        bytes; the last is left for the caller). Returns (None, None): a dense codec's decode of
        its own payload is :meth:`decode`'s."""
        codec, B, dev = self.codec, self.codec.block_size, flat.device
        out[self.header_at] = self.header_want
        if self.blocks == 0:  # empty tensors only: their headers are all there is
            return None, None
        xb = self._blocks(flat.contiguous())
        scales = torch.empty(self.blocks, dtype=torch.float32, device=dev)
        work = torch.empty_like(xb)
        iwork = torch.empty(self.blocks * B, dtype=torch.int32, device=dev)
        codes = torch.empty(self.blocks * B, dtype=torch.uint8, device=dev)
        codec._quantize(xb, scales, work, iwork, codes)
        _copy(self._scale_views(out), self._scale_views_of(scales))
        if self.per == 1:
            _copy(self._code_views(out), self._codes_of(codes))
            return None, None
        codes[self.pad_at] = codec.pad_code  # a short block's missing entries: padding
        _copy(self._code_views(out), self._pack_groups(codes))
        if self.tail_bytes.numel():
            ext = torch.cat([codes, codes.new_full((1,), codec.pad_code)])
            fields = ext[torch.where(self.tail_codes >= 0, self.tail_codes, codes.numel())]
            shifts = torch.arange(self.per, device=dev) * codec.bits
            out[self.tail_bytes] = (fields.to(torch.int32) << shifts).sum(dim=1).to(torch.uint8)
        return None, None

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """The blocks of every tensor as rows of ``B`` (short blocks padded with zeros)."""
        B = self.codec.block_size
        if self.aligned:
            return flat.view(self.blocks, B)
        ext = torch.cat([flat, flat.new_zeros(B)])
        rows = ext.as_strided((self.numel + 1, B), (1, 1)).index_select(0, self.block_start)
        rows.view(-1)[self.pad_at] = 0.0
        return rows

    def _pack_groups(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor's whole planar groups packed (as pack_planar does), one view per
        tensor of its packed bytes."""
        per, bits = self.per, self.codec.bits
        staged = torch.empty(self.full_groups * self.group, dtype=torch.uint8, device=codes.device)
        _copy(self._group_views(staged, self.group), self._full_codes(codes))
        groups = staged.view(-1, per, PLANE_BYTES)
        packed = groups[:, 0].clone()
        for p in range(1, per):  # fields do not overlap: add == or
            packed.add_(groups[:, p], alpha=1 << (bits * p))
        return self._group_views(packed.view(-1), PLANE_BYTES)

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
    def decode(self, payload: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        """(None, the FP32 values of every tensor one after another, a 0-d bool: whether the
        payload breaks a rule the per-tensor decoder checks) of a payload of ``nbytes`` bytes,
        with no host sync."""
        codec, B, dev = self.codec, self.codec.block_size, payload.device
        bad = (payload[self.header_at] != self.header_want).any()
        if self.blocks == 0:  # empty tensors only: their headers are all there is
            return None, torch.zeros(0, device=dev), bad
        scales = torch.empty(self.blocks, dtype=torch.float32, device=dev)
        _copy(self._scale_views_of(scales), self._scale_views(payload))
        bad |= ~(torch.isfinite(scales) & (scales >= 0)).all()
        codes = torch.full((self.blocks * B,), codec.pad_code, dtype=torch.uint8, device=dev)
        if self.per == 1:
            _copy(self._codes_of(codes), self._code_views(payload))
        else:
            self._unpack(payload, codes)
        out = torch.empty(self.blocks, B, dtype=torch.float32, device=dev)
        iwork = torch.empty(self.blocks * B, dtype=torch.int32, device=dev)
        bad |= codec._dequantize(codes, scales, out, iwork)
        return None, self._values(out.view(-1)), bad

    def _unpack(self, payload: torch.Tensor, codes: torch.Tensor) -> None:
        """Every tensor's codes from its packed bytes into ``codes`` (laid out by blocks)."""
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

    def _values(self, blocks: torch.Tensor) -> torch.Tensor:
        """The decoded blocks without their padding: the tensors one after another."""
        if self.aligned:
            return blocks
        out = torch.empty(self.numel, dtype=torch.float32, device=blocks.device)
        B = self.codec.block_size
        _copy(
            [out[e0 : e0 + n] for n, _, _, e0, _, _ in self.spans],
            [blocks[b0 * B : b0 * B + n] for n, _, b0, _, _, _ in self.spans],
        )
        return out

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
