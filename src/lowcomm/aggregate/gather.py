"""The gather exchange: every worker encodes its fragment, the packed payloads are all-gathered
bucket by bucket, and each receiver decodes every worker's payload (the codec's plan, once per
sender) and hands them to the combine rule (decoded in FP32).

A fragment's payload is its buckets' one after another, each its tensors' payloads and one
validity flag byte. One host read per exchange: every sender's flags and whether its payload
decodes (and, tracked, its contribution's norm) read together. A plain rule reads them first and
combines the senders; a payload that breaks a rule stops the sync, its sender named. A robust
rule combines every worker's decode first, leaving out itself what is not a valid, finite
contribution, and the read comes after.
"""

from __future__ import annotations

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
    tensor_splits,
)
from .combine import Combine, Contributions

if TYPE_CHECKING:
    from ..transport import Transport


class GatherAggregator(Aggregator):
    """Combines by all-gathering every worker's encoded fragment and handing the decoded ones to
    the rule (any rule: it sees every contribution).

    Exact for any codec and fine for small M; wire bytes grow as (M-1) x payload.
    """

    method = "gather"
    sums_only = False  # every contribution reaches the rule
    takes_device_flag = True  # the flag byte carries it, read with every sender's
    codec: Codec  # always set here (None only for all-reduce)

    def __init__(self, codec: Codec, world_size: int, aggregation: str | Combine = "mean") -> None:
        super().__init__(codec, world_size, aggregation)
        self._layouts: dict[Any, tuple[Plan, list[int], torch.Tensor]] = {}

    def layout(
        self, shapes: list[torch.Size], buckets: list[int], device: torch.device
    ) -> tuple[Plan, list[int], torch.Tensor]:
        """The codec's plan of a fragment's payload (each bucket: its tensors' payloads, then a
        flag byte), where each bucket's bytes start (and the end), and the flags' places."""
        key = (tuple(tuple(s) for s in shapes), tuple(buckets), str(device))
        if key not in self._layouts:
            at, pos, splits, flags = [], 0, [0], []
            edges = tensor_splits(shapes, buckets)
            for b in range(len(buckets)):
                for shape in shapes[edges[b] : edges[b + 1]]:
                    at.append(pos)
                    pos += self.codec.nbytes(shape)
                flags.append(pos)
                pos += 1
                splits.append(pos)
            plan = self.codec.plan(shapes, device, at)
            flag_at = torch.tensor(flags, dtype=torch.int64).to(device)
            self._layouts[key] = (plan, splits, flag_at)
        return self._layouts[key]

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
        """The fragment's payload (see :meth:`Aggregator.encode`); a device flag ``valid``
        goes out in the flag bytes (peers read it before anything else, and drop a NONFINITE
        sender's bytes unread)."""
        plan, splits, flag_at = self.layout(shapes, buckets, flat.device)
        n = plan.numel
        if valid is False:
            flat = torch.zeros(n, device=flat.device)
        payload = torch.empty(splits[-1], dtype=torch.uint8, device=flat.device)
        idx, values = plan.encode(flat, payload, decoded=bool(want) and not plan.sparse)
        payload[flag_at] = flag_of(valid)  # after the packing, which used the last as scratch
        enc = Encoded(payload, shapes, n, None, key, splits, plan, flag_at=flag_at)
        enc.ok = valid if isinstance(valid, torch.Tensor) else None
        if want == "sparse" and plan.sparse:
            assert idx is not None and values is not None
            enc.sparse_flat = (idx, values)
        elif want and plan.sparse:
            assert idx is not None and values is not None
            enc.local = torch.zeros(n, device=flat.device).index_copy_(0, idx, values)
        elif want:
            enc.local = values
        return enc

    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """All-gather the payloads bucket by bucket and combine the valid ones by the rule
        (weighted: see :meth:`Aggregator.exchange`)."""
        s = enc.splits
        pieces = [self._timed(transport.all_gather, enc.payload[lo:hi]) for lo, hi in zip(s, s[1:])]
        gathered = [torch.cat([rows[w] for rows in pieces]) for w in range(transport.world_size)]
        assert enc.plan is not None and enc.flag_at is not None
        me = transport.rank if enc.keep_unapplied or self.rule.restores else None
        out = enc.out if enc.out is not None else torch.empty(enc.numel, device=enc.payload.device)
        return self.combine(enc.plan, enc.flag_at, gathered, weights, out, me, transport.rank)

    def combine(
        self,
        plan: Plan,
        flag_at: torch.Tensor,
        gathered: list[torch.Tensor],
        weights: list[float] | None,
        out: torch.Tensor,
        me: int | None,
        rank: int,
    ) -> Reduced:
        """The rule's combination of the gathered payloads into ``out``; ``me`` (this worker's
        group rank, where what the weights left of its part unapplied is wanted); ``rank``:
        this worker's, told whether its own payload was flagged NONFINITE."""
        m = len(gathered)
        flags = torch.stack([g[flag_at] for g in gathered]).to(torch.float64)  # [m, buckets]
        # a dense payload is decoded once its sender is known to count (into the sum); a sparse
        # one is small
        lazy = not plan.sparse and not self.rule.robust and not self.track
        if lazy:
            decoded = []
            bad = torch.stack([plan.check(g) for g in gathered]).to(torch.float64)
        else:
            decoded = [plan.decode(g) for g in gathered]
            bad = torch.stack([d[2] for d in decoded]).to(torch.float64)
        norms = [d[1].double().square().sum() for d in decoded] if self.track else []
        if self.rule.robust:  # every worker's decode to the rule, the read after
            present = (flags[:, 0] == SENT) & (bad == 0)
            parts = Contributions(plan, [(i, v) for i, v, _ in decoded], None, present)
            self.rule.combine(parts, out)
            unapplied = self.rule.unapplied(parts, me) if me is not None else None
            left = self.rule.left_out()
            lost = [] if left is None or not self.track else [self._elements(parts, left)]
            read = self._read(flags, bad, norms, lost)
            senders = [w for w in range(m) if read["flags"][w] == SENT]
            if me not in senders:
                unapplied = None
        else:  # the read first: which senders, and whether one's payload breaks a rule
            read = self._read(flags, bad, norms, [])
            senders = [w for w in range(m) if read["flags"][w] == SENT]
            for w in senders:
                if read["bad"][w]:
                    names = [f"tensor {i} from worker {w}" for i in range(len(plan.shapes))]
                    try:
                        plan.explain(gathered[w], names)
                    except PayloadError as err:
                        raise PayloadError(str(err), w) from None
            ws = [weights[w] for w in senders] if weights is not None else None
            if lazy:
                parts = Contributions(plan, None, ws, payloads=[gathered[w] for w in senders])
            else:
                parts = Contributions(plan, [decoded[w][:2] for w in senders], ws)  # type: ignore[misc]
            if not senders:
                out.zero_()
            else:
                self.rule.combine(parts, out)
            asks = me in senders and (ws is not None or self.rule.restores)
            unapplied = self.rule.unapplied(parts, senders.index(me)) if asks else None  # type: ignore[arg-type]
        told = {
            "nonfinite": tuple(w for w in range(m) if read["flags"][w] == NONFINITE),
            "left_out_here": read["flags"][rank] == NONFINITE if 0 <= rank < m else False,
        }
        tracked = None
        if self.track:
            tracked = {w: _squared(read, w) for w in senders}
            for w in senders:  # left out of most of what it sent: it offends
                if read["lost"] and 2 * read["lost"][w] > plan.numel:
                    tracked[w] = float("inf")
        return Reduced(out, len(senders), unapplied, tracked, **told)

    def _read(
        self,
        flags: torch.Tensor,
        bad: torch.Tensor,
        norms: list[torch.Tensor],
        lost: list[torch.Tensor],
    ) -> dict[str, list]:
        """The one host read: every sender's flags (PayloadError naming a sender whose flags are
        not one this run sends, or disagree between buckets), whether its payload decodes, its
        squared norm and the elements a robust rule left out of its part, where asked."""
        m = flags.shape[0]
        extra = [n.view(1) for n in norms] + [x.double() for x in lost]
        got = torch.cat([flags.view(-1), bad, *extra]).tolist()
        each = flags.shape[1]
        rows = [got[w * each : (w + 1) * each] for w in range(m)]
        at = m * each
        read: dict[str, list] = {"bad": got[at : at + m]}
        at += m
        read["norms"] = got[at : at + len(norms)]
        at += len(norms)
        read["lost"] = got[at : at + (m if lost else 0)]
        read["flags"] = []
        for w, row in enumerate(rows):
            v = flag(row[0] if row else 1, w, self.deferred_checks)
            if any(x != row[0] for x in row):
                raise PayloadError(f"payload from worker {w} has validity flags {row}", w)
            read["flags"].append(v)
        return read

    @staticmethod
    def _elements(parts: Contributions, left: torch.Tensor) -> torch.Tensor:
        """Per part, how many of the fragment's elements the rule left out (``left``: [m, T])."""
        sizes = parts.elements.lengths_t.to(torch.float64)
        return (left.to(torch.float64) * sizes).sum(dim=1)

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """The codec's bytes per tensor, plus the flag byte."""
        return sum(self.codec.nbytes(s) for s in shapes) + 1


def _squared(read: dict[str, list], w: int) -> float:
    """Sender ``w``'s squared norm as read: inf where it did not decode or held a NaN."""
    v = read["norms"][w]
    return float("inf") if read["bad"][w] or v != v else v
