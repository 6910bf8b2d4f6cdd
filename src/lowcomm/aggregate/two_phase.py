"""The two-phase exchange: shard, all-to-all, each owner sums its shard in FP32, re-encodes the
average (compensated when asked) and all-gathers it. Wire bytes stay about 2 x payload at any M.

The fragment's flat buffer is cut into M shards, each a whole number of the codec's scale blocks
so a block never straddles two owners, hence element-wise codecs only; worker j owns shard j.
Each shard is cut again into one piece per bucket (whole blocks too), and a bucket's collectives
move that piece of every shard: all-to-all, then all-gather. Every piece is a tensor of the
codec's plan, ordered shard by shard, so what arrives decodes, in one pass, as the shards one
after another: a sender's contributions to this worker's shard, then every owner's average,
which is the fragment's mean.

The re-encode is a second lossy quantisation: with ``reduce_compensation`` (LoCo's moving
average, or error feedback) it is compensated like the first, with its own buffer for the shard
this worker owns, keyed by the ``key`` given to ``encode`` (docs/algorithms.md, LoCo).
``reduce_scatter`` stops after the first phase (FSDP needs only that half).

A sender's validity flag rides in each of its rows, on the device where the finite check is
deferred; one host read at the end of the exchange takes every sender's flags and whether what
arrived decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..codecs.base import Codec, PayloadError, Plan
from .base import (
    NONFINITE,
    SENT,
    Aggregator,
    Encoded,
    Reduced,
    Valid,
    flag,
    flag_of,
    numel,
    scaled_unapplied,
)
from .combine import Combine

if TYPE_CHECKING:
    from ..compensation import Compensation
    from ..transport import Transport


@dataclass(frozen=True)
class Shards:
    """How one fragment goes through the two-phase exchange: shards of ``shard`` elements, each
    in ``pieces`` (one per bucket), and the plans of what is sent, received and gathered."""

    shard: int
    pieces: list[int]
    send: Plan  # every shard's pieces, shard by shard; row j of bucket b: shard j's piece b
    regions: list[int]  # where bucket b's rows start in a sent (or received) buffer; the end
    flag_at: torch.Tensor  # every row's flag byte
    own: Plan  # this worker's shard's pieces, one after another
    gathered: Plan  # every owner's pieces as the all-gathers land them (rows without flags)
    gathered_regions: list[int]


class TwoPhaseAggregator(Aggregator):
    """Combines by reduce-scatter (all-to-all of encoded shards, each owner combining its shard
    by the rule) then all-gather of the combined shards. The codec must be element-wise (the
    config checks it) and the rule a sum (a shard's sum is the sum's shard)."""

    method = "two-phase"
    takes_device_flag = True
    codec: Codec  # always set here (None only for all-reduce)

    def __init__(
        self,
        codec: Codec,
        world_size: int,
        reduce_compensation: Compensation | None = None,
        aggregation: str | Combine = "mean",
    ) -> None:
        super().__init__(codec, world_size, aggregation)
        self.reduce_compensation = reduce_compensation
        self._layouts: dict[Any, Shards] = {}

    # -- layout ----------------------------------------------------------------------------------
    def shards(self, shard: int, buckets: int, device: torch.device) -> Shards:
        """The layout of shards of ``shard`` elements sent in ``buckets`` collectives each way
        (built once)."""
        key = (shard, buckets, str(device))
        if key not in self._layouts:
            self._layouts[key] = self._layout(shard, buckets, device)
        return self._layouts[key]

    def _layout(self, shard: int, buckets: int, device: torch.device) -> Shards:
        m, block = self.world_size, getattr(self.codec, "block_size", 1)
        per = -(-shard // buckets)
        step = -(-per // block) * block  # whole blocks a piece
        pieces = [max(0, min(step, shard - b * step)) for b in range(buckets)]
        widths = [self.codec.nbytes(torch.Size([p])) for p in pieces]
        regions, gathered_regions, pos, gpos = [0], [0], 0, 0
        for w in widths:
            pos += m * (w + 1)
            gpos += m * w
            regions.append(pos)
            gathered_regions.append(gpos)
        shapes = [torch.Size([p]) for _ in range(m) for p in pieces]
        at = [regions[b] + j * (w + 1) for j in range(m) for b, w in enumerate(widths)]
        got = [gathered_regions[b] + j * w for j in range(m) for b, w in enumerate(widths)]
        flags = [a + widths[i % len(widths)] for i, a in enumerate(at)]
        own_at, pos = [], 0
        for w in widths:
            own_at.append(pos)
            pos += w
        return Shards(
            shard=shard,
            pieces=pieces,
            send=self.codec.plan(shapes, device, at),
            regions=regions,
            flag_at=torch.tensor(flags, dtype=torch.int64).to(device),
            own=self.codec.plan([torch.Size([p]) for p in pieces], device, own_at),
            gathered=self.codec.plan(shapes, device, got),
            gathered_regions=gathered_regions,
        )

    def _shard_len(self, total: int) -> int:
        """Elements per shard: a whole number of the codec's scale blocks."""
        n = -(-total // self.world_size) if total else 0
        block = getattr(self.codec, "block_size", 1)
        return -(-n // block) * block

    # -- encode (compute thread) -----------------------------------------------------------------
    def encode(
        self,
        flat: torch.Tensor,
        shapes: list[torch.Size],
        buckets: list[int],
        valid: Valid = True,
        want: str = "",
        key: str | None = None,
        slab: torch.Tensor | None = None,
    ) -> Encoded:
        """Shard the fragment and encode every shard's pieces (see :meth:`Aggregator.encode`)."""
        n = flat.numel()
        layout = self.shards(self._shard_len(n), len(buckets), flat.device)
        padded = torch.zeros(self.world_size * layout.shard, device=flat.device)
        if valid is not False:
            padded[:n] = flat
        enc = self._encoded(layout, padded, valid, bool(want), key)
        enc.shapes, enc.numel = list(shapes), n
        if enc.local is not None:
            enc.local = enc.local[:n]
        return enc

    def encode_shards(
        self,
        shards: torch.Tensor,
        need_local: bool = False,
        valid: Valid = True,
        key: str | None = None,
    ) -> Encoded:
        """Two-phase encode of ``shards`` (M x n, FP32), row j for worker j: FSDP's own layout."""
        if shards.shape[0] != self.world_size:
            raise ValueError(
                f"need one shard per worker ({self.world_size}), got {shards.shape[0]}"
            )
        layout = self.shards(shards.shape[1], 1, shards.device)
        padded = shards.reshape(-1) if valid is not False else torch.zeros_like(shards).view(-1)
        enc = self._encoded(layout, padded, valid, need_local, key)
        enc.shapes, enc.numel = [shards.shape], shards.numel()
        return enc

    def _encoded(
        self, layout: Shards, padded: torch.Tensor, valid: Valid, local: bool, key: str | None
    ) -> Encoded:
        payload = torch.empty(layout.regions[-1], dtype=torch.uint8, device=padded.device)
        _, values = layout.send.encode(padded, payload, decoded=local)
        payload[layout.flag_at] = flag_of(valid)
        ok = valid if isinstance(valid, torch.Tensor) else None
        enc = Encoded(payload, [], padded.numel(), values, key, layout.regions, layout.send)
        enc.ok, enc.flag_at, enc.shard_numel = ok, layout.flag_at, layout.shard
        enc.layout = layout
        return enc

    # -- exchange (may run on the comm thread) ---------------------------------------------------
    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """Reduce-scatter, re-encode this worker's averaged shard, all-gather every shard
        (weighted: see :meth:`Aggregator.exchange`)."""
        red, check = self._scatter(enc, transport, weights)
        layout: Shards = enc.layout
        mine, comp = red.mean, self.reduce_compensation
        # a left-out worker changes nothing here (every owner averages the valid ones alike);
        # with no valid worker at all there is nothing to compensate
        use = comp is not None and enc.key is not None and red.valid_workers != 0
        ckey = f"{enc.key}/reduced shard" if use else None
        h = comp.before_send(ckey, mine) if ckey is not None and comp is not None else mine
        payload = torch.empty(layout.own.span + 1, dtype=torch.uint8, device=mine.device)
        _, sent = layout.own.encode(h, payload, decoded=ckey is not None)
        if ckey is not None and comp is not None:
            comp.after_send(ckey, h, sent)
        own = layout.own.at + [layout.own.span]
        rows = [self._timed(transport.all_gather, payload[a:b]) for a, b in zip(own, own[1:])]
        landed = torch.cat([r for bucket in rows for r in bucket])
        _, out, bad = layout.gathered.decode(landed)
        check["owners"] = (bad, landed)
        valid_workers, told = self._checked(check, enc, transport.rank)
        unapplied = scaled_unapplied(self.rule, enc, weights, transport.rank)
        return Reduced(out[: enc.numel], valid_workers, unapplied, None, **told)

    def reduce_scatter(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """Two-phase, first half only: the rule's FP32 combination of this worker's shard (one
        quantisation). The shard's length is ``enc.shard_numel``; FSDP's reduce-scatter is
        exactly this."""
        red, check = self._scatter(enc, transport, weights)
        valid_workers, told = self._checked(check, enc, transport.rank)
        return Reduced(red.mean, valid_workers, **told)

    def _scatter(
        self, enc: Encoded, transport: Transport, weights: list[float] | None
    ) -> tuple[Reduced, dict[str, Any]]:
        """The first phase: every sender's pieces of this worker's shard, summed by the rule;
        with what the last check reads (its ``valid_workers`` is the count when known, else
        -1: the check reads it)."""
        layout: Shards = enc.layout
        m, r = self.world_size, layout.regions
        received = []
        for b in range(len(layout.pieces)):
            region = enc.payload[r[b] : r[b + 1]].view(m, -1)
            received += self._timed(transport.all_to_all, list(region.unbind(0)))
        # received[b * m + s]: sender s's row of bucket b; laid out again as the send buffer
        landed = torch.cat(
            [received[b * m + s] for b in range(len(layout.pieces)) for s in range(m)]
        )
        _, values, bad = layout.send.decode(landed)
        flags = landed[layout.flag_at].view(m, len(layout.pieces))
        values = values.view(m, layout.shard)
        sent = flags[:, 0] == SENT
        known = enc.senders is not None and enc.senders == m and weights is None
        mine = torch.zeros(layout.shard, dtype=torch.float32, device=values.device)
        for s in range(m):  # sender after sender: the same bits on every owner
            w = weights[s] if weights is not None else None
            part = values[s] if w is None else values[s] * w
            mine += part if known else torch.where(sent[s], part, 0.0)
        if weights is not None:
            total: float | torch.Tensor = float(sum(weights))
        elif known:
            total = float(m)
        else:
            total = sent.sum().to(torch.float32)
        self.rule.finish(mine, total)  # type: ignore[arg-type]
        count = m if known else (sum(1 for w in weights if w > 0) if weights is not None else -1)
        check = {"flags": flags, "senders": (bad, landed), "known": known}
        return Reduced(mine, count), check

    def _checked(
        self, check: dict[str, Any], enc: Encoded, rank: int
    ) -> tuple[int, dict[str, Any]]:
        """The exchange's one host read: every sender's flags and whether its pieces and every
        owner's average decoded; PayloadError naming the sender or owner of a broken one.
        Returns the valid senders' count and what the flags told."""
        layout: Shards = enc.layout
        flags = check["flags"]
        bad_sent, landed = check["senders"]
        bad_owned, gathered = check.get("owners", (torch.zeros((), dtype=torch.bool), None))
        read = torch.cat(
            [flags.reshape(-1).double(), bad_sent.double().view(1), bad_owned.double().view(1)]
        ).tolist()
        m, each = flags.shape
        rows = [read[s * each : (s + 1) * each] for s in range(m)]
        got = [flag(row[0], s, self.deferred_checks) for s, row in enumerate(rows)]
        for s, row in enumerate(rows):
            if any(x != row[0] for x in row):
                raise PayloadError(f"payload from worker {s} has validity flags {row}", s)
        senders = [s for s in range(m) if got[s] == SENT]
        if read[-2]:  # some piece did not decode: whose, among the senders
            self._blame(layout.send, landed, senders, "shard {owner} from worker {who}", rank)
        if read[-1] and gathered is not None:
            self._blame(layout.gathered, gathered, list(range(m)), "averaged shard {who}", rank)
        told = {
            "nonfinite": tuple(s for s in range(m) if got[s] == NONFINITE),
            "left_out_here": got[rank] == NONFINITE,
        }
        return len(senders), told

    def _blame(self, plan: Plan, buf: torch.Tensor, who: list[int], name: str, rank: int) -> None:
        """PayloadError naming the first of ``who`` whose rows of ``buf`` do not decode."""
        per = len(plan.shapes) // self.world_size
        for w in who:
            names = [name.format(owner=rank, who=w)] * per
            sub = _rows(plan, w, per)
            try:
                sub.explain(buf, names)
            except PayloadError as err:
                raise PayloadError(str(err), w) from None

    # -- sizes -----------------------------------------------------------------------------------
    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """M shard payloads, each with its flag byte."""
        total = sum(numel(s) for s in shapes)
        return self.world_size * (self.codec.nbytes(torch.Size([self._shard_len(total)])) + 1)


class _Rows(Plan):
    """The pieces of one sender (or owner) of a two-phase plan, for :meth:`Plan.explain`."""

    def __init__(self, plan: Plan, first: int, count: int) -> None:
        self.codec = plan.codec
        self.shapes = plan.shapes[first : first + count]
        self.at = plan.at[first : first + count]
        self.widths = plan.widths[first : first + count]


def _rows(plan: Plan, who: int, per: int) -> Plan:
    return _Rows(plan, who * per, per)
