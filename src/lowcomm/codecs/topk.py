"""Chunked top-k: the SparseLoCo format (docs/algorithms.md §3).

Chunks. A tensor is viewed as 2-D ``R x C``: a 2-D tensor as itself, a tensor with more than 2
dims as ``shape[0] x prod(shape[1:])`` (the "first dim x rest" view of a weight), a 1-D or 0-d
tensor as ``1 x numel``. The ``R x C`` matrix is cut into tiles ``tr x tc`` where each side is
the largest divisor of that dimension <= 64 (so 1-D tensors are cut into pieces of the largest
divisor of their length <= 64; a 4096 x 4096 weight into 4096 tiles of 64 x 64). Every tile
keeps ``k = max(1, round(L * density))`` entries (``L = tr * tc``, rounded half to even, at most
``L``): the k largest in magnitude and, among equal magnitudes, the lower indices.

Wire format::

    header (16 bytes, parameter = k)
    values:  the value codec's payload for the K = n_tiles * k kept values, tile by tile in
             row-major tile order and, within a tile, by increasing index
             (default ``LutCodec(2)``: 2 bits per value + a 36-byte table; any element-wise
             codec works, e.g. fp32, bf16, int8, fp4)
    indices: K tile-local indices ``r * tc + c``, ``ceil(log2 L)`` bits each (12 for a 64 x 64
             tile, 6 for a 64-piece, 0 for a 1-element tile), packed with bitpack.pack_bits

A 0-element tensor is the header alone. A decoder rejects indices >= L and indices that are not
strictly increasing within a tile (which also rules out duplicates). Bits per element:
``K * (ceil(log2 L) + value bits) / numel`` (e.g. 64/4096 * (12 + 2) = 0.219 at density 1/64).

A :class:`TopKPlan` encodes and decodes a bucket at once, in launches that do not grow with its
number of tensors:

- **Selection.** The tiles of one geometry (``tr x tc``, ``k``) of every tensor form a group
  (:class:`Tiles`), selected by the ``select`` kernel (:mod:`.kernels`).
- **Values.** The value codec's own plan over every tensor's kept values, at their places.
- **Indices.** One set of packed streams (:class:`~.bitpack.Streams`); headers written at once.
"""

from __future__ import annotations

import torch

from . import kernels
from ._format import HEADER_BYTES, check_payload, numel_of, set_headers
from .base import Codec, PayloadError, Plan
from .bitpack import Stream, Streams, bits_for, packed_nbytes, unpack_bits
from .lut import LutCodec
from .registry import make_codec, register

MAX_SIDE = 64
#: elements per band of the torch selection: bounds its temporaries (about 24 bytes an element)
BAND_ELEMS = 1 << 23


def largest_divisor(n: int, limit: int = MAX_SIDE) -> int:
    """The largest divisor of ``n`` that is <= ``limit`` (1 for n <= 1)."""
    for d in range(min(n, limit), 1, -1):
        if n % d == 0:
            return d
    return 1


class _Geometry:
    __slots__ = ("n", "R", "C", "tr", "tc", "L", "k", "ntj", "ntiles", "K", "index_bits")

    def __init__(self, shape, density: float) -> None:
        shape = tuple(shape)
        self.n = n = numel_of(shape)
        if len(shape) >= 2 and n:
            self.R = shape[0]
            self.C = n // shape[0]
        else:
            self.R, self.C = 1, n
        self.tr = largest_divisor(self.R)
        self.tc = largest_divisor(self.C)
        self.L = self.tr * self.tc
        # half to even, as the SparseLoCo authors' code (Python's round) does
        self.k = min(self.L, max(1, round(self.L * density)))
        self.ntj = self.C // self.tc if n else 0
        self.ntiles = (self.R // self.tr) * self.ntj if n else 0
        self.K = self.ntiles * self.k
        self.index_bits = bits_for(self.L)


@register(
    "topk",
    wire_id=8,
    options=("density", "value_bits", "value_codec"),
    elementwise=False,
    sparse=True,
)
class TopKCodec(Codec):
    def __init__(
        self,
        density: float = 1 / 64,
        value_bits: int = 2,
        value_codec: Codec | None = None,
    ) -> None:
        if not (isinstance(density, (int, float)) and 0 < density <= 1):
            raise ValueError(f"top-k density must be in (0, 1], got {density!r}")
        self.density = float(density)
        if value_codec is None:  # 32 bits: the values as they are, FP32
            value_codec = make_codec("fp32") if value_bits == 32 else LutCodec(value_bits)
        elif isinstance(value_codec, str):  # a codec name (value_codec="fp32" in make_codec)
            value_codec = make_codec(value_codec)
        if not isinstance(value_codec, Codec) or not value_codec.elementwise:
            raise ValueError(f"top-k values need an element-wise codec, got {value_codec!r}")
        self.value_codec = value_codec

    def __repr__(self) -> str:
        return f"TopKCodec(density={self.density}, value_codec={self.value_codec!r})"

    def describe(self) -> str:
        return f"topk(density={self.density}, values={self.value_codec!r})"

    def geometry(self, shape) -> _Geometry:
        return _Geometry(shape, self.density)

    def _layout(self, g: _Geometry) -> tuple[int, int, int]:
        if g.n == 0:
            return HEADER_BYTES, HEADER_BYTES, HEADER_BYTES
        idx_at = HEADER_BYTES + self.value_codec.nbytes((g.K,))
        return HEADER_BYTES, idx_at, idx_at + packed_nbytes(g.K, g.index_bits)

    def nbytes(self, shape: torch.Size) -> int:
        return self._layout(self.geometry(shape))[2]

    def formula_bits_per_param(self, shape: torch.Size) -> float:
        g = self.geometry(shape)
        if g.n == 0:
            return 0.0
        vbits = self.value_codec.formula_bits_per_param((g.K,))
        return g.K * (g.index_bits + vbits) / g.n

    def _make_plan(
        self, shapes: list[torch.Size], device: torch.device, at: list[int] | None
    ) -> TopKPlan:
        self.value_codec.kernels = self.kernels
        return TopKPlan(self, shapes, device, at)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One tensor's top-k per tile: (tile-local indices (ntiles, k), increasing in each
        row, and the kept values (ntiles, k) in FP32)."""
        g = self.geometry(x.shape)
        plan = self.plan([x.shape], x.device)
        local, values = plan.select(x.detach().reshape(-1).float())
        return local.view(g.ntiles, g.k), values.view(g.ntiles, g.k)

    def decode_sparse(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated (flat int64 indices (K,), fp32 values (K,)) of one tensor's payload."""
        idx, values = self.decode_parts(payload, shape, name)
        assert idx is not None
        return idx, values

    def explain(self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor") -> None:
        shape = torch.Size(shape)
        g = self.geometry(shape)
        _, idx_at, total = self._layout(g)
        payload = check_payload(
            payload,
            name=name,
            codec=self.name,
            describe=self.describe(),
            expected_nbytes=total,
            param=g.k,
            numel=g.n,
            shape=shape,
        )
        if g.n == 0:
            return
        values = payload[HEADER_BYTES:idx_at]
        vname = f"{name} (top-k values)"
        self.value_codec.explain_size(values, torch.Size([g.K]), vname)
        self.value_codec.explain(values, torch.Size([g.K]), vname)
        local = unpack_bits(payload[idx_at:], g.index_bits, g.K).view(g.ntiles, g.k)
        if bool((local >= g.L).any()):
            bad = local[local >= g.L][:3].tolist()
            raise PayloadError(f"{name}: top-k index out of range: {bad} >= tile size {g.L}")
        if g.k > 1 and bool((local[:, 1:] <= local[:, :-1]).any()):
            raise PayloadError(
                f"{name}: top-k indices not strictly increasing within a tile (duplicates or "
                "unsorted)"
            )


class Tiles:
    """The tiles of one geometry, over every tensor of a plan: each tile's first element in the
    flat input, its tensor's row length, and where its k values go among all kept values.
    Where every tile row starts on a multiple of ``tc`` (``rows``), the torch selection
    gathers a tile as ``tr`` whole rows of ``tc`` elements (an index per row); else element
    by element."""

    def __init__(self, tr: int, tc: int, k: int, index_bits: int, rows: bool) -> None:
        self.tr, self.tc, self.k, self.index_bits, self.rows = tr, tc, k, index_bits, rows
        self.L = tr * tc
        self.base: list[torch.Tensor] = []
        self.row: list[torch.Tensor] = []
        self.kept_at: list[torch.Tensor] = []

    def add(self, g: _Geometry, elem_at: int, kept_at: int) -> None:
        """The tiles of one tensor of geometry ``g``, its first element at ``elem_at``."""
        t = torch.arange(g.ntiles, dtype=torch.int64)
        self.base.append(elem_at + (t // g.ntj) * (g.tr * g.C) + (t % g.ntj) * g.tc)
        self.row.append(torch.full((g.ntiles,), g.C, dtype=torch.int64))
        self.kept_at.append(kept_at + t * g.k)

    def to(self, device: torch.device) -> None:
        """Fix the tile lists on ``device``, with the offsets of an element within a tile."""
        base, row = torch.cat(self.base), torch.cat(self.row)
        self.kept_t = torch.cat(self.kept_at).to(device)
        self.ntiles = base.numel()
        at = torch.arange(self.L, dtype=torch.int64)
        self.base_t, self.row_t = base.to(device), row.to(device)
        if self.rows:  # each tile's rows, as indices of tc-element rows of the input
            r = torch.arange(self.tr, dtype=torch.int64)
            self.row_index = ((base[:, None] + r * row[:, None]) // self.tc).view(-1).to(device)
        else:
            self.r, self.c = (at // self.tc).to(device), (at % self.tc).to(device)
        self.rev = (self.L - 1 - at).to(device)  # the lower index ranks higher among ties
        self.lane = torch.arange(self.k, dtype=torch.int64, device=device)
        self.band = max(1, BAND_ELEMS // self.L)
        del self.base, self.row, self.kept_at

    def tiles(self, flat: torch.Tensor, s: int) -> torch.Tensor:
        """Tiles ``s`` to ``s + band`` of ``flat`` as rows of ``L`` (tile-local order)."""
        if self.rows:
            as_rows = flat.as_strided((flat.numel() // self.tc, self.tc), (self.tc, 1))
            picked = self.row_index[s * self.tr : (s + self.band) * self.tr]
            return as_rows.index_select(0, picked).view(-1, self.L)
        base, row = self.base_t[s : s + self.band], self.row_t[s : s + self.band]
        return flat.take(base[:, None] + self.r * row[:, None] + self.c)


class TopKPlan(Plan):
    """One bucket's shapes under one top-k codec, on one device (see the module doc)."""

    sparse = True

    def __init__(
        self,
        codec: TopKCodec,
        shapes: list[torch.Size],
        device: torch.device,
        at: list[int] | None = None,
    ) -> None:
        super().__init__(codec, shapes, device, at)
        self.kernels = kernels.choose(device, codec.kernels)
        geos = [codec.geometry(s) for s in self.shapes]
        set_headers(self, [g.k for g in geos])
        indices, per_tensor, value_shapes, value_at = [], [], [], []
        groups: dict[tuple[int, int, int, bool], Tiles] = {}
        kept = 0
        for g, a, elem in zip(geos, self.at, self.starts):
            if g.n:
                value_shapes.append(torch.Size([g.K]))
                value_at.append(a + HEADER_BYTES)
                indices.append(Stream(kept, g.K, g.index_bits, a + codec._layout(g)[1]))
                rows = elem % g.tc == 0 and g.tc >= 16
                key = (g.tr, g.tc, g.k, rows)
                group = groups.setdefault(key, Tiles(g.tr, g.tc, g.k, g.index_bits, rows))
                group.add(g, elem, kept)
                per_tensor.append((elem, kept, g.K, g.k, g.tr, g.tc, g.C, g.ntj, g.L))
            kept += g.K
        self.kept = kept
        self.kept_sizes = [g.K for g in geos]  # each tensor's kept values (a decode's segments)
        self.tensors = len(per_tensor)
        self.groups = list(groups.values())
        for grp in self.groups:
            grp.to(device)
        self.values = codec.value_codec.plan(value_shapes, device, value_at)
        self.indices = Streams(indices, device)
        cols = torch.tensor(per_tensor, dtype=torch.int64).reshape(-1, 9).t().to(device)
        (
            self.elem_at,
            self.kept_at,
            self.count,
            self.k,
            self.tr,
            self.tc,
            self.row,
            self.ntj,
            self.tile,
        ) = cols.contiguous()
        self.seg = torch.repeat_interleave(
            torch.arange(self.tensors, device=device), self.count, output_size=kept
        )
        self.first = self.kept_at[self.seg]  # each kept value's tensor's first kept value
        # each kept value's tile's first element, and its tensor's tile width and row length
        # (flat_index's, worked out once)
        seg = self.seg
        tile = torch.div(
            torch.arange(kept, device=device) - self.first, self.k[seg], rounding_mode="floor"
        )
        ti = torch.div(tile, self.ntj[seg], rounding_mode="floor")
        self.slot_tc, self.slot_row = self.tc[seg], self.row[seg]
        self.slot_base = (
            self.elem_at[seg] + ti * self.tr[seg] * self.slot_row
            + (tile - ti * self.ntj[seg]) * self.slot_tc
        )  # fmt: skip
        self.first_in_tile = (torch.arange(kept, device=device) - self.first) % self.k[seg] == 0

    # ---- encode ------------------------------------------------------------------------------
    def encode(
        self, flat: torch.Tensor, out: torch.Tensor, decoded: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``flat`` (the tensors, FP32, one after another) into ``out``; returns what
        peers decode of it, as (flat indices into ``flat``, values)."""
        local, values = self.select(flat.contiguous())  # (rows are read as a strided view)
        out[self.header_at] = self.header_want
        _, sent = self.values.encode(values, out, decoded=True)
        self.indices.pack(local, out, out.numel() - 1, self.kernels)
        assert sent is not None
        return self.flat_index(local), sent

    def select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every tile's kept (tile-local indices, values), tensor after tensor, tile after
        tile, each tile's in increasing index order (the payload's order)."""
        local = torch.empty(self.kept, dtype=torch.int64, device=flat.device)
        values = torch.empty(self.kept, dtype=torch.float32, device=flat.device)
        for grp in self.groups:
            self.kernels.select(flat, grp, local, values)
        return local, values

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat indices, FP32 values, a 0-d bool: whether the payload breaks a rule of the
        format) of ``payload`` read at the plan's places, with no host read."""
        bad = self.headers_bad(payload)
        _, values, bad_values = self.values.decode(payload)
        local = self.indices.unpack(payload, self.kept, self.kernels)
        seg = self.seg
        bad |= bad_values | (local >= self.tile[seg]).any()
        first = self.first_in_tile  # a tile's first index has no predecessor
        bad |= ((local[1:] <= local[:-1]) & ~first[1:]).any()
        return self.flat_index(local), values, bad

    def flat_index(self, local: torch.Tensor) -> torch.Tensor:
        """Tile-local indices (the payload's order) -> indices into the flat tensors: the
        tile's first element, then the index's row and column in it."""
        r = torch.div(local, self.slot_tc, rounding_mode="floor")
        return self.slot_base + r * self.slot_row + (local - r * self.slot_tc)
