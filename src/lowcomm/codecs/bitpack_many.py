"""Many bit-packed streams at once, laid out exactly as :func:`.bitpack.pack_bits` lays out each.

A codec that encodes many tensors into one buffer writes one packed stream per tensor (top-k's
2-bit codes and its tile indices). Packing them one by one costs a handful of kernel launches
per stream; on an accelerator that, not memory bandwidth, is the cost. :class:`Streams` cuts
every stream's planar slices into *segments* of at most one group (``256 * per`` codes, the
unit of :func:`.bitpack.pack_planar`) and packs or unpacks every segment of one slice width in
one pass: a number of launches that depends on the widths in use (at most four), not on the
number of streams.

A segment is ``(first value, codes, bytes, first byte, shift)``: its ``codes`` values, shifted
right by ``shift`` and masked to the slice's width, fill ``bytes`` bytes from ``first byte`` in
the planar order (code ``j`` in byte ``j % bytes`` at bit ``width * (j // bytes)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bitpack import PLANE_BYTES, _slices, planar_nbytes


@dataclass(frozen=True)
class Stream:
    """``count`` values from ``first`` of a value vector, ``bits`` wide each, packed by
    ``pack_bits``'s layout from payload byte ``at``."""

    first: int
    count: int
    bits: int
    at: int


class Streams:
    """The segments of many streams, by slice width, on one device (a few small tensors)."""

    def __init__(self, streams: list[Stream], device: torch.device) -> None:
        rows: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for s in streams:
            at, shift = s.at, 0
            for width in _slices(s.bits):
                rows.setdefault(width, []).extend(_segments(s, width, at, shift))
                at += planar_nbytes(s.count, width)
                shift += width
        self.by_width = {
            w: torch.tensor(r, dtype=torch.int64, device=device).t().contiguous()
            for w, r in sorted(rows.items())
            if r
        }

    def pack(self, values: torch.Tensor, out: torch.Tensor, sink: int) -> None:
        """Write the streams of ``values`` (1-D, integers >= 0) into ``out`` (uint8); bytes
        past a segment's end go to ``out[sink]``, which the caller overwrites afterwards."""
        dev = out.device
        ext = torch.cat([values.to(torch.int64), values.new_zeros(1, dtype=torch.int64)])
        none = values.numel()  # the appended zero: what a padding field holds
        lane = torch.arange(PLANE_BYTES, device=dev)
        for width, (first, count, nbytes, at, shift) in self.by_width.items():
            per = 8 // width
            plane = torch.arange(per, device=dev)[None, :, None]
            j = plane * nbytes[:, None, None] + lane  # (segments, per, 256): each field's code
            used = (lane < nbytes[:, None, None]) & (j < count[:, None, None])
            codes = ext[torch.where(used, first[:, None, None] + j, none)]
            codes = (codes >> shift[:, None, None]) & ((1 << width) - 1)
            byte = (codes << (width * plane)).sum(dim=1)  # fields do not overlap: sum == or
            dest = torch.where(lane < nbytes[:, None], at[:, None] + lane, sink)
            out.index_put_((dest.view(-1),), byte.view(-1).to(torch.uint8))

    def unpack(self, payload: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` values (int64) the streams hold in ``payload`` (uint8)."""
        dev = payload.device
        out = torch.zeros(count + 1, dtype=torch.int64, device=dev)  # [count]: a sink
        for width, (first, n, nbytes, at, shift) in self.by_width.items():
            per = 8 // width
            j = torch.arange(PLANE_BYTES * per, device=dev)[None, :]
            used = j < n[:, None]
            plane = torch.where(used, torch.div(j, nbytes[:, None], rounding_mode="floor"), 0)
            byte = torch.where(used, at[:, None] + j - plane * nbytes[:, None], 0)
            field = (payload[byte].to(torch.int64) >> (width * plane)) & ((1 << width) - 1)
            where = torch.where(used, first[:, None] + j, count)
            # slices of one value land in different segments: add == or, integers (exact)
            out.index_add_(0, where.view(-1), (field << shift[:, None]).view(-1))
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
