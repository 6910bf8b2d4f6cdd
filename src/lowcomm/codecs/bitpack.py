"""Bit packing with vectorised torch ops (CPU and CUDA alike, no Python loop over elements).

Two layouts, both exact to the bit count (no padding beyond the last partial byte):

**Planar codes** (``pack_planar``) for code widths ``bits`` in {1, 2, 4, 8}: ``per = 8 // bits``
codes share a byte. Codes are taken in groups of ``256 * per``; a group of ``g`` codes (every
group is full except possibly the last) occupies ``nb = ceil(g / per)`` bytes, and code ``j`` of
the group sits in byte ``j % nb`` at bit offset ``bits * (j // nb)`` (bit 0 = least significant).
For a full int4 group: byte ``i`` holds code ``i`` in its low nibble and code ``i + 256`` in its
high nibble. Splitting a group into ``per`` contiguous planes (rather than interleaving
neighbours) lets packing read and write whole contiguous rows, which is several times faster
on a CPU than strided byte access. Unused bits of the last byte are padding.

**Wide values** (``pack_bits``) for any width 0..24 (top-k indices: 12 bits for a 4096 chunk):
the width is split into bit slices of 8, 8, ..., 4, 2, 1 (the binary digits of ``bits``,
low bits first); slice ``i`` of every value is packed as one planar stream, and the streams are
concatenated. 12-bit indices are therefore ``n`` bytes of low bits followed by ``ceil(n/2)``
bytes of high nibbles. ``packed_nbytes(n, bits)`` is the exact size.

**Many streams at once** (:class:`Streams`): a bucket of tensors writes one packed stream per
tensor (top-k's codes and tile indices). Every stream's planar slices are cut into *segments* of
at most one group (``256 * per`` codes, the unit of ``pack_planar``), and every segment of one
slice width is packed or unpacked in one pass: launches that depend on the widths in use (at
most four), not on the number of streams. A segment is ``(first value, codes, bytes, first
byte, shift)``: its ``codes`` values, shifted right by ``shift`` and masked to the slice's
width, fill ``bytes`` bytes from ``first byte`` in the planar order (code ``j`` in byte
``j % bytes`` at bit ``width * (j // bytes)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PLANE_BYTES = 256  # bytes per plane of a full group


def _slices(bits: int) -> list[int]:
    """Widths of the bit slices ``pack_bits`` uses for ``bits``-bit values, low bits first."""
    if not 0 <= bits <= 24:
        raise ValueError(f"bit width must be in 0..24, got {bits}")
    out = [8] * (bits // 8)
    rest = bits % 8
    for p in (4, 2, 1):
        if rest & p:
            out.append(p)
    return out


def planar_nbytes(n: int, bits: int) -> int:
    """Bytes ``pack_planar`` uses for ``n`` codes of ``bits`` bits (bits in 1, 2, 4, 8)."""
    return (n * bits + 7) // 8


def packed_nbytes(n: int, bits: int) -> int:
    """Exact bytes ``pack_bits`` uses for ``n`` values of ``bits`` bits."""
    return sum(planar_nbytes(n, p) for p in _slices(bits))


def pack_planar(
    codes: torch.Tensor, bits: int, out: torch.Tensor | None = None, pad: int = 0
) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes (each < 2**bits) into ``planar_nbytes`` bytes.

    ``pad`` fills the unused fields of the last byte. ``out`` (1-D uint8, exact size) may be a
    slice of a larger payload.
    """
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"planar packing needs bits in (1, 2, 4, 8), got {bits}")
    n = codes.numel()
    nbytes = planar_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if bits == 8:
        out.copy_(codes)
        return out
    per = 8 // bits
    group = PLANE_BYTES * per
    full = n // group
    if full:
        cv = codes[: full * group].view(full, per, PLANE_BYTES)
        ov = out[: full * PLANE_BYTES].view(full, PLANE_BYTES)
        # fields do not overlap, so add == or; add takes an alpha (no shifted temporary)
        torch.add(cv[:, 0], cv[:, 1], alpha=1 << bits, out=ov)
        for i in range(2, per):
            ov.add_(cv[:, i], alpha=1 << (bits * i))
    m = n - full * group
    if m:
        nb = -(-m // per)
        tail = torch.full((per * nb,), pad, dtype=torch.uint8, device=codes.device)
        tail[:m] = codes[full * group :]
        tv = tail.view(per, nb)
        ot = out[full * PLANE_BYTES :]
        ot.copy_(tv[0])
        for i in range(1, per):
            ot.add_(tv[i], alpha=1 << (bits * i))
    return out


def unpack_planar(
    packed: torch.Tensor, bits: int, n: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``pack_planar``: ``n`` uint8 codes. ``packed`` must hold exactly the bytes."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"planar packing needs bits in (1, 2, 4, 8), got {bits}")
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if bits == 8:
        out.copy_(packed[:n])
        return out
    per = 8 // bits
    mask = (1 << bits) - 1
    group = PLANE_BYTES * per
    full = n // group

    def planes(src: torch.Tensor, dst: torch.Tensor) -> None:
        # src (..., nb) bytes -> dst (..., per, nb) codes
        for i in range(per):
            if i == 0:
                torch.bitwise_and(src, mask, out=dst[..., 0, :])
            elif i == per - 1:
                torch.bitwise_right_shift(src, bits * i, out=dst[..., i, :])
            else:
                torch.bitwise_and(src >> (bits * i), mask, out=dst[..., i, :])

    if full:
        planes(
            packed[: full * PLANE_BYTES].view(full, PLANE_BYTES),
            out[: full * group].view(full, per, PLANE_BYTES),
        )
    m = n - full * group
    if m:
        nb = -(-m // per)
        tail = torch.empty(per * nb, dtype=torch.uint8, device=packed.device)
        planes(packed[full * PLANE_BYTES : full * PLANE_BYTES + nb], tail.view(per, nb))
        out[full * group :] = tail[:m]
    return out


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack non-negative integers (< 2**bits, any integer dtype, 1-D) into exact bytes."""
    v = values.reshape(-1)
    parts = []
    shift = 0
    for p in _slices(bits):
        sl = (v >> shift) & ((1 << p) - 1) if shift or p < bits else v
        parts.append(pack_planar(sl.to(torch.uint8), p))
        shift += p
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: an int64 tensor of ``n`` values. ``packed`` must be exact."""
    out = torch.zeros(n, dtype=torch.int64, device=packed.device)
    pos = 0
    shift = 0
    for p in _slices(bits):
        nb = planar_nbytes(n, p)
        codes = unpack_planar(packed[pos : pos + nb], p, n)
        if shift:
            out.add_(codes.to(torch.int64) << shift)  # slices do not overlap: add == or
        else:
            out.copy_(codes)
        pos += nb
        shift += p
    return out


def bits_for(n: int) -> int:
    """ceil(log2(n)) bits to address ``n`` positions (0 for n <= 1)."""
    return 0 if n <= 1 else (n - 1).bit_length()


@dataclass(frozen=True)
class Stream:
    """``count`` values from ``first`` of a value vector, ``bits`` wide each, packed by
    ``pack_bits``'s layout from payload byte ``at``."""

    first: int
    count: int
    bits: int
    at: int


class Streams:
    """The segments of many streams, by slice width, on one device: the gathers that pack and
    unpack them worked out once (a few index tensors about as long as the values)."""

    def __init__(self, streams: list[Stream], device: torch.device) -> None:
        rows: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for s in streams:
            at, shift = s.at, 0
            for width in _slices(s.bits):
                rows.setdefault(width, []).extend(_segments(s, width, at, shift))
                at += planar_nbytes(s.count, width)
                shift += width
        self.count = max((s.first + s.count for s in streams), default=0)
        # every segment as (first, count, nbytes, at, shift, width): the C kernels' walk
        self.rows = torch.tensor(
            [(*r, w) for w, rs in sorted(rows.items()) for r in rs], dtype=torch.int64
        ).reshape(-1, 6)
        self.packs, self.unpacks = [], []
        lane = torch.arange(PLANE_BYTES, device=device)
        for width, r in sorted(rows.items()):
            if not r:
                continue
            first, count, nbytes, at, shift = (
                torch.tensor(r, dtype=torch.int64, device=device).t().contiguous()
            )
            per = 8 // width
            plane = torch.arange(per, device=device)[None, :, None]
            j = plane * nbytes[:, None, None] + lane  # (segments, per, 256): each field's code
            used = (lane < nbytes[:, None, None]) & (j < count[:, None, None])
            src = torch.where(used, first[:, None, None] + j, self.count)  # count: a zero
            inside = (lane < nbytes[:, None]).view(-1)
            dest = (at[:, None] + lane).view(-1)
            self.packs.append((width, src, shift[:, None, None], width * plane, dest, inside))
            k = torch.arange(PLANE_BYTES * per, device=device)[None, :]
            fits = k < count[:, None]
            fplane = torch.where(fits, torch.div(k, nbytes[:, None], rounding_mode="floor"), 0)
            byte = torch.where(fits, at[:, None] + k - fplane * nbytes[:, None], 0)
            where = torch.where(fits, first[:, None] + k, self.count).view(-1)  # count: a sink
            self.unpacks.append((width, byte, width * fplane, shift[:, None], where))

    def pack(self, values: torch.Tensor, out: torch.Tensor, sink: int, kernels: Any = None) -> None:
        """Write the streams of ``values`` (1-D, integers >= 0) into ``out`` (uint8); bytes
        past a segment's end go to ``out[sink]``, which the caller overwrites afterwards.
        ``kernels``: the plan's (:mod:`.kernels`; else the torch steps)."""
        if kernels is not None:
            kernels.pack_streams(self, values, out, sink)
        else:
            self.pack_torch(values, out, sink)

    def unpack(self, payload: torch.Tensor, count: int, kernels: Any = None) -> torch.Tensor:
        """The ``count`` values (int64) the streams hold in ``payload`` (uint8)."""
        if kernels is not None:
            return kernels.unpack_streams(self, payload, count)  # type: ignore[no-any-return]
        return self.unpack_torch(payload, count)

    def pack_torch(self, values: torch.Tensor, out: torch.Tensor, sink: int) -> None:
        """:meth:`pack` by torch steps: a gather and a sum per slice width."""
        ext = torch.cat([values.to(torch.int64), values.new_zeros(1, dtype=torch.int64)])
        for width, src, shift, planes, dest, inside in self.packs:
            codes = (ext[src] >> shift) & ((1 << width) - 1)
            byte = (codes << planes).sum(dim=1)  # fields do not overlap: sum == or
            out.index_put_((torch.where(inside, dest, sink),), byte.view(-1).to(torch.uint8))

    def unpack_torch(self, payload: torch.Tensor, count: int) -> torch.Tensor:
        """:meth:`unpack` by torch steps: a gather and an index-add per slice width."""
        out = torch.zeros(self.count + 1, dtype=torch.int64, device=payload.device)
        for width, byte, planes, shift, where in self.unpacks:
            field = (payload[byte].to(torch.int64) >> planes) & ((1 << width) - 1)
            # slices of one value land in different segments: add == or, integers (exact)
            out.index_add_(0, where, (field << shift).view(-1))
        return out[:count]


def _segments(s: Stream, width: int, at: int, shift: int) -> list[tuple[int, int, int, int, int]]:
    """One slice of one stream cut into pack_planar's groups (the last one partial)."""
    per = 8 // width
    group = PLANE_BYTES * per
    full = s.count // group
    out = [
        (s.first + g * group, group, PLANE_BYTES, at + g * PLANE_BYTES, shift) for g in range(full)
    ]
    rest = s.count - full * group
    if rest:
        out.append((s.first + full * group, rest, -(-rest // per), at + full * PLANE_BYTES, shift))
    return out
