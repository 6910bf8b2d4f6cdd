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
"""

from __future__ import annotations

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
