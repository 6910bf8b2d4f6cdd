"""Chunked top-k: the SparseLoCo format (docs/algorithms.md §3).

Chunks. A tensor is viewed as 2-D ``R x C``: a 2-D tensor as itself, a tensor with more than 2
dims as ``shape[0] x prod(shape[1:])`` (the "first dim x rest" view of a weight), a 1-D or 0-d
tensor as ``1 x numel``. The ``R x C`` matrix is cut into tiles ``tr x tc`` where each side is
the largest divisor of that dimension <= 64 (so 1-D tensors are cut into pieces of the largest
divisor of their length <= 64; a 4096 x 4096 weight into 4096 tiles of 64 x 64). Every tile
keeps ``k = max(1, round(L * density))`` entries (``L = tr * tc``, rounded half to even, at most
``L``), the k largest in magnitude (ties broken by ``torch.topk``).

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
"""

from __future__ import annotations

import torch

from . import _native
from ._format import (
    HEADER_BYTES,
    as_float_input,
    check_payload,
    chunk_elems,
    numel_of,
    write_header,
)
from .base import Codec, PayloadError
from .bitpack import bits_for, pack_bits, packed_nbytes, unpack_bits
from .lut import LutCodec
from .registry import make_codec, register
from .topk_many import TopKPlan, wanted

MAX_SIDE = 64


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

    def global_index(self, local: torch.Tensor) -> torch.Tensor:
        """(ntiles, k) tile-local indices -> flat indices into the row-major tensor."""
        t = torch.arange(self.ntiles, device=local.device)
        base = (t // self.ntj) * (self.tr * self.C) + (t % self.ntj) * self.tc
        r = torch.div(local, self.tc, rounding_mode="floor")
        return base[:, None] + r * self.C + (local - r * self.tc)


def _group_size(L: int, k: int) -> int:
    """Group size for the two-stage exact top-k (1: plain torch.topk is cheaper)."""
    if L < 1024 or k == 1:
        return 1
    best, cost = 1, L
    for g in range(2, 65):
        if L % g == 0 and L // g >= k and L // g + g * k < cost:
            best, cost = g, L // g + g * k
    return best if cost <= L // 2 else 1


def _topk_indices(mag: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """Indices of the k largest entries of each row of ``mag`` (rows, L), unordered.

    With ``group > 1`` (CPU: torch.topk costs ~10 ns an element there), two exact stages:
    split each row into G = L / group groups of ``group`` neighbours, keep the k groups with
    the largest maxima, then take the top k of their k * group elements. Exact: every element
    larger than the k-th largest group maximum lies in a kept group, and the kept groups hold
    k elements at least that large, so the k largest values survive (equal values may be
    exchanged for one another, as torch.topk may do too). For 64x64 tiles and k = 64 this runs
    topk over 1024 instead of 4096 elements per tile. Neighbouring groups make the second
    stage a copy of whole 32-byte rows, not a gather; the magnitudes (>= 0, so their bit
    patterns order like the values) are compared as int32, which topk sorts faster.
    """
    if k == 1:
        return mag.argmax(dim=1, keepdim=True)
    if group <= 1:
        return torch.topk(mag, k, dim=1, sorted=False).indices
    rows, L = mag.shape
    G = L // group
    bits = mag.view(torch.int32)
    gmax = bits.view(rows, G, group).amax(dim=2)
    top_groups = torch.topk(gmax, k, dim=1, sorted=False).indices  # (rows, k)
    first = torch.arange(0, rows * G, G, device=mag.device).unsqueeze(1)
    cand = bits.view(rows * G, group).index_select(0, (top_groups + first).view(-1))
    pick = torch.topk(cand.view(rows, k * group), k, dim=1, sorted=False).indices
    in_group = torch.div(pick, group, rounding_mode="floor")
    return torch.gather(top_groups, 1, in_group) * group + (pick - in_group * group)


def _lowest_among_ties(mag: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``idx`` (rows, k), the k largest of each row of ``mag``, with the tie rule made exact:
    where more entries equal the k-th largest than are kept, keep the lowest indices (torch.topk
    leaves that choice open; the fused kernel makes this one). Rows without such a tie are
    left as they are: their set is unique."""
    bits = mag.view(torch.int32)
    least = torch.gather(bits, 1, idx).amin(dim=1, keepdim=True)
    above = (bits > least).sum(dim=1)
    equal = (bits == least).sum(dim=1)
    tied = (equal > idx.shape[1] - above).nonzero().view(-1)
    if tied.numel() == 0:
        return idx
    L = mag.shape[1]
    # a unique key per entry: magnitude first, then the lower index
    key = bits[tied].to(torch.int64) * L + (L - 1 - torch.arange(L, device=mag.device))
    idx = idx.clone()
    idx[tied] = torch.topk(key, idx.shape[1], dim=1, sorted=False).indices
    return idx


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
        if value_codec is None:
            value_codec = LutCodec(value_bits)
        elif isinstance(value_codec, str):  # a codec name (value_codec="fp32" in make_codec)
            value_codec = make_codec(value_codec)
        if not isinstance(value_codec, Codec) or not value_codec.elementwise:
            raise ValueError(f"top-k values need an element-wise codec, got {value_codec!r}")
        self.value_codec = value_codec
        self._plans: dict[tuple, TopKPlan] = {}  # plan() caches one per (shapes, device)

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

    # ---- encode ------------------------------------------------------------------------------
    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k per tile: (tile-local indices (ntiles, k), increasing in each row, and the
        kept values (ntiles, k) in FP32). Among equal magnitudes the lower index is kept."""
        flat = as_float_input(x)
        g = self.geometry(x.shape)
        dev = flat.device
        local = torch.empty(g.ntiles, g.k, dtype=torch.int64, device=dev)
        values = torch.empty(g.ntiles, g.k, dtype=torch.float32, device=dev)
        if g.n == 0:
            return local, values
        kernels = _native.usable(flat)
        if kernels is not None and not kernels.lc_topk_select(  # one read, the same bits
            _native.ptr(flat), g.R, g.C, g.tr, g.tc, g.k, _native.ptr(local), _native.ptr(values)
        ):
            return local, values
        nti = g.R // g.tr
        row_elems = g.tr * g.C  # one row of tiles
        band = max(1, chunk_elems(dev) // row_elems)
        mag = torch.empty(min(band, nti) * row_elems, dtype=torch.float32, device=dev)
        x2 = flat.view(g.R, g.C)
        t = torch.arange(min(band, nti) * g.ntj, device=dev)
        tile_at = (t // g.ntj) * row_elems + (t % g.ntj) * g.tc  # each tile's offset in a band
        group = _group_size(g.L, g.k) if dev.type == "cpu" else 1
        for b0 in range(0, nti, band):
            nb = min(band, nti - b0)
            rows = nb * g.ntj
            xb = x2[b0 * g.tr : (b0 + nb) * g.tr]
            src = xb.view(nb, g.tr, g.ntj, g.tc).permute(0, 2, 1, 3)
            mt = mag[: nb * row_elems].view(rows, g.L)
            # the tiles' magnitudes, gathered in one pass over x (no signed copy of the tiles)
            torch.abs(src, out=mt.view(nb, g.ntj, g.tr, g.tc))
            li = _lowest_among_ties(mt, _topk_indices(mt, g.k, group))
            li = li.sort(dim=1).values  # canonical order (k is small)
            local[b0 * g.ntj : b0 * g.ntj + rows] = li
            r = torch.div(li, g.tc, rounding_mode="floor")
            at = tile_at[:rows, None] + r * g.C + (li - r * g.tc)  # the kept entries in the band
            out = values[b0 * g.ntj : b0 * g.ntj + rows].view(-1)
            torch.index_select(xb.reshape(-1), 0, at.view(-1), out=out)
        return local, values

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan([x.shape], x.device) if wanted(x.device) else None
        if plan is not None:  # an accelerator: the plan's few launches (topk_many)
            payload = torch.empty(plan.nbytes + 1, dtype=torch.uint8, device=x.device)
            plan.encode(as_float_input(x), payload)
            return payload[:-1]
        g = self.geometry(x.shape)
        _, idx_at, total = self._layout(g)
        payload = torch.empty(total, dtype=torch.uint8, device=x.device)
        write_header(payload, self.name, g.k, g.n)
        if g.n == 0:
            return payload
        local, values = self.select(x)
        payload[HEADER_BYTES:idx_at] = self.value_codec.encode(values.view(-1))
        payload[idx_at:] = pack_bits(local.view(-1), g.index_bits)
        return payload

    # ---- many tensors at once (an accelerator's path: topk_many) -----------------------------
    def plan(self, shapes: list[torch.Size], device: torch.device) -> TopKPlan | None:
        """The plan that encodes and decodes tensors of ``shapes`` together on ``device``
        (cached), or None where this codec has none (a value codec other than the table)."""
        if not isinstance(self.value_codec, LutCodec):
            return None
        key = (tuple(tuple(s) for s in shapes), str(device))
        if key not in self._plans:
            self._plans[key] = TopKPlan(self, [torch.Size(s) for s in shapes], device)
        return self._plans[key]

    # ---- decode ------------------------------------------------------------------------------
    def decode_sparse(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated (flat int64 indices (K,), fp32 values (K,)) of a payload."""
        shape = torch.Size(shape)
        plan = self._checked_plan(payload, shape)
        if plan is not None:  # one host read; a payload that breaks a rule goes on below
            idx, values, bad = plan.decode(payload)
            if not bool(bad):
                return idx, values
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
        dev = payload.device
        if g.n == 0:
            return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, device=dev)
        values = self.value_codec.decode(
            payload[HEADER_BYTES:idx_at], (g.K,), name=f"{name} (top-k values)"
        )
        kernels = _native.usable(payload)
        if kernels is not None:  # unpacked, checked and placed in one pass (the same bits)
            flat = torch.empty(g.K, dtype=torch.int64)
            if not kernels.lc_topk_indices(
                _native.ptr(payload[idx_at:]),
                g.K,
                g.index_bits,
                g.k,
                g.L,
                g.ntj,
                g.tr,
                g.tc,
                g.C,
                _native.ptr(flat),
            ):
                return flat, values
        local = unpack_bits(payload[idx_at:], g.index_bits, g.K).view(g.ntiles, g.k)
        if bool((local >= g.L).any()):
            bad = local[local >= g.L][:3].tolist()
            raise PayloadError(f"{name}: top-k index out of range: {bad} >= tile size {g.L}")
        if g.k > 1 and bool((local[:, 1:] <= local[:, :-1]).any()):
            raise PayloadError(
                f"{name}: top-k indices not strictly increasing within a tile (duplicates or "
                "unsorted)"
            )
        return g.global_index(local).view(-1), values

    def _checked_plan(self, payload: torch.Tensor, shape: torch.Size) -> TopKPlan | None:
        """The plan that decodes ``payload`` on its device, if it takes this path and is a
        uint8 tensor of the right size (anything else is for check_payload to describe)."""
        if not (isinstance(payload, torch.Tensor) and wanted(payload.device)):
            return None
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            return None
        plan = self.plan([shape], payload.device)
        return plan if plan is not None and payload.numel() == plan.nbytes else None

    def decode(
        self, payload: torch.Tensor, shape: torch.Size, name: str = "tensor"
    ) -> torch.Tensor:
        shape = torch.Size(shape)
        idx, values = self.decode_sparse(payload, shape, name)
        out = torch.zeros(numel_of(shape), dtype=torch.float32, device=values.device)
        out.index_copy_(0, idx, values)
        return out.view(shape)
