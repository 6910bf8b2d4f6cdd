"""Top-k over many tensors at once: what :class:`~.topk.TopKCodec` writes for each tensor in
turn, and its validated decode, in kernel launches that depend on the tensors' total size and
not on their count (an accelerator's path: the per-tensor codec launched about 220 kernels and
several host synchronisations per tensor, a GPT-2 small sync 32,726).

- **Selection.** The tiles of one geometry (``tr x tc``, ``k``) of every tensor are gathered
  into rows, a band at a time, and ranked by one ``topk`` over a key that orders by magnitude,
  then by the lower index: the per-tensor rule exactly, ties included, in increasing index
  order. A tile of ``k = 1`` is an ``argmax`` (the first maximum is the lower index).
- **Values.** Each tensor's 2-bit lookup table by the lookup codec's formulas, from segment
  sums taken as differences of one float64 prefix sum (every run adds in the same order:
  deterministic, where atomic adds are not). Its statistics may differ from the per-tensor
  codec's in their last bit, as the CPU's and CUDA's reductions do; the indices never differ.
- **Packing.** :mod:`.bitpack_many`; headers from a template built once per plan.

A plan is built once per (shapes, device) and cached by the codec.
"""

from __future__ import annotations

import os

import torch

from . import _triton
from ._format import HEADER_BYTES, write_header
from .bitpack_many import Stream, Streams

#: elements per band of the selection: bounds its temporaries (about 24 bytes an element)
BAND_ELEMS = 1 << 23


def wanted(device: torch.device) -> bool:
    """Whether work on ``device`` goes many tensors at once (this plan, the engine's
    multi-tensor kernels): on accelerators, where a launch costs more than its bytes (the CPU
    keeps its fused per-tensor kernels and cache-sized chunks); ``LOWCOMM_BATCH=1`` forces it
    (tests), ``0`` turns it off."""
    forced = os.environ.get("LOWCOMM_BATCH", "")
    return forced == "1" or (forced != "0" and device.type != "cpu")


class _Group:
    """The tiles of one geometry, over every tensor: each tile's first element in the flat
    input, its tensor's row length, and where its k values go among all kept values. Where
    every tile row starts on a multiple of ``tc`` (``rows``), a tile is gathered as ``tr``
    whole rows of ``tc`` elements (an index per row, kept); else element by element."""

    def __init__(self, tr: int, tc: int, k: int, index_bits: int, rows: bool) -> None:
        self.tr, self.tc, self.k, self.index_bits, self.rows = tr, tc, k, index_bits, rows
        self.L = tr * tc
        self.base: list[torch.Tensor] = []
        self.row: list[torch.Tensor] = []
        self.kept_at: list[torch.Tensor] = []

    def add(self, g, elem_at: int, kept_at: int) -> None:  # g: a topk._Geometry
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
        self.base_t, self.row_t = base.to(device), row.to(device)  # (the fused kernel's too)
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


class TopKPlan:
    """One bucket's shapes under one top-k codec, on one device: :meth:`encode` and
    :meth:`decode` of all of them at once. ``sparse``: decodes are (indices, values)."""

    sparse = True

    def __init__(self, codec, shapes: list[torch.Size], device: torch.device) -> None:
        self.codec, self.device = codec, device
        self.lut = lut = codec.value_codec
        self.levels = lut.levels
        geos = [codec.geometry(s) for s in shapes]
        self.nbytes = sum(codec.nbytes(s) for s in shapes)
        template = torch.zeros(self.nbytes, dtype=torch.uint8)
        headers: list[torch.Tensor] = []
        groups: dict[tuple[int, int, int], _Group] = {}
        codes, indices, per_tensor, stats_at = [], [], [], []
        elem = kept = at = 0
        for shape, g in zip(shapes, geos):
            write_header(template[at : at + HEADER_BYTES], codec.name, g.k, g.n)
            headers.append(torch.arange(at, at + HEADER_BYTES))
            if g.n:
                lut_at = at + HEADER_BYTES
                write_header(template[lut_at : lut_at + HEADER_BYTES], lut.name, lut.bits, g.K)
                headers.append(torch.arange(lut_at, lut_at + HEADER_BYTES))
                stats_at.append(torch.arange(lut_at + HEADER_BYTES, lut_at + lut._codes_at()))
                codes.append(Stream(kept, g.K, lut.bits, lut_at + lut._codes_at()))
                indices.append(Stream(kept, g.K, g.index_bits, at + codec._layout(g)[1]))
                rows = elem % g.tc == 0 and g.tc >= 16
                key = (g.tr, g.tc, g.k, rows)
                group = groups.setdefault(key, _Group(g.tr, g.tc, g.k, g.index_bits, rows))
                group.add(g, elem, kept)
                per_tensor.append((elem, kept, g.K, g.k, g.tr, g.tc, g.C, g.ntj, g.L))
            elem += g.n
            kept += g.K
            at += codec.nbytes(shape)
        self.kept = kept
        self.tensors = len(per_tensor)
        self.groups = list(groups.values())
        for grp in self.groups:
            grp.to(device)
        self.template = template.to(device)
        self.header_at = torch.cat(headers).to(device)
        self.header_want = self.template[self.header_at]
        self.stats_at = (torch.cat(stats_at) if stats_at else torch.empty(0, dtype=torch.int64)).to(
            device
        )
        self.codes = Streams(codes, device)
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
        self.kept_end = self.kept_at + self.count

    # ---- encode ------------------------------------------------------------------------------
    def encode(self, flat: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode ``flat`` (the tensors, FP32, one after another) into ``out`` (``nbytes + 1``
        bytes: the last is scratch, for the caller to overwrite); returns what peers decode of
        it, as (flat indices into ``flat``, values)."""
        local, values = self.select(flat.contiguous())  # (rows are read as a strided view)
        codes, stats, decoded = self.table(values)
        body = out[: self.nbytes]
        body.copy_(self.template)
        body[self.stats_at] = stats.reshape(-1).view(torch.uint8)
        self.codes.pack(codes, out, sink=self.nbytes)
        self.indices.pack(local, out, sink=self.nbytes)
        return self.flat_index(local), decoded

    def select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every tile's kept (tile-local indices, values), tensor after tensor, tile after
        tile, each tile's in increasing index order (the payload's order).

        Ranked by magnitude with ``topk``; where a tile's k-th magnitude is shared by more
        entries than were kept, which of them is kept is the rule's to say (the lower index)
        and ``topk``'s choice may differ: then everything is ranked again by an exact key (one
        host read says whether; ties are rare outside planted data such as zero rows). Where
        Triton runs, a group is selected by its fused kernel instead: the same rule, exactly,
        in one read of the tiles and no host read."""
        local = torch.empty(self.kept, dtype=torch.int64, device=flat.device)
        values = torch.empty(self.kept, dtype=torch.float32, device=flat.device)
        rest = [grp for grp in self.groups if not self._fused(flat, local, values, grp)]
        tied = [self._select(flat, local, values, grp, exact=False) for grp in rest]
        if tied and bool(torch.stack(tied).any()):
            for grp in rest:
                self._select(flat, local, values, grp, exact=True)
        return local, values

    @staticmethod
    def _fused(flat: torch.Tensor, local: torch.Tensor, values: torch.Tensor, grp: _Group) -> bool:
        """One group's selection by the fused kernel; False where it does not run."""
        return _triton.select_tiles(
            flat, grp.base_t, grp.row_t, grp.kept_t, grp.tc, grp.L, grp.k, local, values
        )

    def _select(
        self,
        flat: torch.Tensor,
        local: torch.Tensor,
        values: torch.Tensor,
        grp: _Group,
        exact: bool,
    ) -> torch.Tensor:
        """One group's selection into ``local`` and ``values``; whether a tile's choice among
        equal magnitudes was left to ``topk`` (a 0-d bool)."""
        tied = torch.zeros((), dtype=torch.bool, device=flat.device)
        for s in range(0, grp.ntiles, grp.band):
            x = grp.tiles(flat, s)
            li, t = _ranked(x, grp, exact)
            tied |= t
            dest = (grp.kept_t[s : s + grp.band, None] + grp.lane).view(-1)
            local.index_copy_(0, dest, li.view(-1))
            values.index_copy_(0, dest, x.gather(1, li).view(-1))
        return tied

    def table(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The lookup codec's codes, per-tensor statistics (T x (1 + levels): shift, table) and
        decoded values for the kept values ``v`` (see :class:`~.lut.LutCodec`)."""
        L, seg, dev = self.levels, self.seg, v.device
        n = self.count.double()
        shift = (self._sums(v.double()) / n).float()
        centred = v - shift[seg]
        m = torch.zeros(self.tensors, device=dev).scatter_reduce_(
            0, seg, centred.abs(), "amax", include_self=True
        )
        m = torch.where(m > 0, m, 1.0)  # std of the values scaled to [-1, 1], scaled back
        y = (centred / m[seg]).double()
        dev2 = (y - (self._sums(y) / n)[seg]).square()
        sigma = torch.where(n > 1, (self._sums(dev2) / (n - 1).clamp(min=1)).sqrt(), 0.0)
        sigma = sigma.float() * m
        width = torch.where(sigma > 0, sigma * (6.0 / L), 1.0)
        y32 = centred / width[seg]
        # a NaN (a tensor holding one: its shift is NaN) codes as 0, as the per-tensor codec's
        # cast to uint8 leaves it; receivers refuse its NaN table either way
        codes = y32.add_(L // 2).round_().clamp_(0, L - 1).to(torch.int64).clamp_(0, L - 1)
        bins = seg * L + codes
        counts = torch.bincount(bins, minlength=self.tensors * L)
        order = torch.argsort(bins, stable=True)
        ends = counts.cumsum(0)
        sums = _differences(centred.double()[order], ends - counts, ends)
        centres = (torch.arange(L, device=dev) - L // 2) * width[:, None]
        lut = torch.where(
            counts.view(-1, L) > 0,
            (sums / counts.clamp(min=1)).float().view(-1, L),
            centres,
        )
        stats = torch.cat([shift[:, None], lut], dim=1)
        decoded = lut.view(-1)[bins] + shift[seg]
        return codes, stats, decoded

    def _sums(self, x: torch.Tensor) -> torch.Tensor:
        """Each tensor's sum of ``x`` (float64, one entry per kept value); NaN for a tensor
        holding a non-finite entry (which then poisons no other tensor's sum)."""
        finite = torch.isfinite(x)
        sums = _differences(torch.where(finite, x, 0.0), self.kept_at, self.kept_end)
        bad = torch.zeros(self.tensors, dtype=torch.float64, device=x.device)
        bad.index_add_(0, self.seg, (~finite).double())  # whole numbers: exact in any order
        return torch.where(bad > 0, float("nan"), sums)

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat indices, FP32 values, a 0-d bool: whether the payload breaks a rule the
        per-tensor decoder checks) of a payload of ``nbytes`` bytes, with no host sync: a
        caller that finds it True decodes per tensor for the error that names the fault."""
        bad = (payload[self.header_at] != self.header_want).any()
        stats = payload[self.stats_at].view(torch.float32).view(self.tensors, 1 + self.levels)
        bad |= ~torch.isfinite(stats).all()
        codes = self.codes.unpack(payload, self.kept)
        local = self.indices.unpack(payload, self.kept)
        seg = self.seg
        values = stats[:, 1:].reshape(-1)[seg * self.levels + codes] + stats[:, 0][seg]
        bad |= (local >= self.tile[seg]).any()
        within = torch.arange(self.kept, device=payload.device) - self.kept_at[seg]
        first = within % self.k[seg] == 0  # a tile's first index has no predecessor
        bad |= ((local[1:] <= local[:-1]) & ~first[1:]).any()
        return self.flat_index(local), values, bad

    def flat_index(self, local: torch.Tensor) -> torch.Tensor:
        """Tile-local indices (the payload's order) -> indices into the flat tensors."""
        seg = self.seg
        tile = torch.div(
            torch.arange(self.kept, device=local.device) - self.kept_at[seg],
            self.k[seg],
            rounding_mode="floor",
        )
        ntj, tc = self.ntj[seg], self.tc[seg]
        ti = torch.div(tile, ntj, rounding_mode="floor")
        r = torch.div(local, tc, rounding_mode="floor")
        rows = ti * self.tr[seg] + r
        cols = (tile - ti * ntj) * tc + (local - r * tc)
        return self.elem_at[seg] + rows * self.row[seg] + cols


def _ranked(x: torch.Tensor, grp: _Group, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile-local indices of each row's k largest magnitudes, in increasing order, and
    whether some row's choice among equal magnitudes was topk's (never when ``exact``: then
    the key orders by magnitude, as int32 bit patterns, and then by the lower index)."""
    mag = x.abs()
    no = torch.zeros((), dtype=torch.bool, device=x.device)
    if grp.k == 1:  # the first maximum: the lower index among equal ones
        return mag.argmax(dim=1, keepdim=True), no
    if grp.k == grp.L:
        return grp.lane.expand(x.shape[0], grp.k), no
    if not exact:
        top = mag.topk(grp.k, dim=1, sorted=False)
        least = top.values.amin(dim=1, keepdim=True)
        tied = ((mag >= least).sum(dim=1) > grp.k).any()
        return top.indices.sort(dim=1).values, tied
    key = (mag.view(torch.int32).to(torch.int64) << grp.index_bits) | grp.rev
    top = key.topk(grp.k, dim=1, sorted=False).values
    return ((grp.L - 1) - (top & ((1 << grp.index_bits) - 1))).sort(dim=1).values, no


def _differences(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``sum(x[starts[i]:ends[i]])`` for each i, as differences of one prefix sum."""
    prefix = torch.cat([x.new_zeros(1), x.cumsum(0)])
    return prefix[ends] - prefix[starts]
