"""The gather exchange: every worker encodes each tensor, the packed payloads are all-gathered,
and each receiver hands the valid ones, tensor by tensor, to the combine rule (decoded in FP32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs.base import Codec, PayloadError
from . import batched
from .base import NONFINITE, SENT, Aggregator, Encoded, Reduced, Valid, contribution, flag, numel
from .combine import Combine, Parts

if TYPE_CHECKING:
    from ..transport import Transport


class GatherAggregator(Aggregator):
    """Combines by all-gathering every worker's encoded tensors and handing the decoded ones to
    the rule (any rule: it sees every contribution).

    Exact for any codec and fine for small M; wire bytes grow as (M-1) x payload.
    """

    method = "gather"
    sums_only = False  # every contribution reaches the rule
    codec: Codec  # always set here (None only for all-reduce)

    def __init__(self, codec: Codec, world_size: int, aggregation: str | Combine = "mean") -> None:
        super().__init__(codec, world_size, aggregation)

    def encode(
        self,
        tensors: list[torch.Tensor],
        need_local: bool = False,
        valid: Valid = True,
        key: str | None = None,
        slab: torch.Tensor | None = None,
        sparse_local: bool = False,
        flat: torch.Tensor | None = None,
    ) -> Encoded:
        """Each tensor encoded, then one flag byte (see :meth:`Aggregator.encode`); where the
        codec has a plan for the whole bucket on this device, the bucket at once (the same
        bytes: :mod:`.batched`), which also takes ``valid`` on the device (:meth:`defers`)."""
        plan = self.plan([t.shape for t in tensors], tensors[0].device) if tensors else None
        if plan is not None:
            want = "" if not need_local else "sparse" if sparse_local else "dense"
            return batched.encode(plan, tensors, valid, flat, want, key)
        assert isinstance(valid, bool), "a device flag needs a plan (defers)"
        tensors, shapes, n = contribution(tensors, valid)
        parts = [self.codec.encode(t) for t in tensors]
        flag_byte = torch.tensor(
            [int(valid)], dtype=torch.uint8, device=parts[0].device if parts else None
        )
        payload = torch.cat(parts + [flag_byte])
        sparse = getattr(self.codec, "decode_sparse", None)
        if need_local and sparse_local and sparse is not None:
            mine = [sparse(p, s) for p, s in zip(parts, shapes)]  # K-sized, no dense copy
            return Encoded(payload, shapes, n, None, key, sparse=mine)
        local = None
        if need_local:
            local = self._decode_flat(payload[:-1], shapes, n)
        return Encoded(payload, shapes, n, local, key)

    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """All-gather the payloads and combine the valid ones by the rule (weighted: see
        :meth:`Aggregator.exchange`)."""
        payload = enc.payload
        gathered = self._timed(transport.all_gather, payload)
        me = transport.rank if enc.keep_unapplied else None
        plan = self.plan(enc.shapes, payload.device)
        if plan is not None and batched.combines(plan, self.rule, weights, me):
            got = batched.combine(
                plan,
                self.rule,
                gathered,
                enc.numel,
                weights,
                enc.out,
                self.track,
                transport.rank,
                self.deferred_checks,
            )
            if got is not None:
                return got
        flags = self._flags(gathered)
        got = self._sum_gathered(gathered, enc.shapes, enc.numel, weights, enc.out, me, flags)
        got.nonfinite = tuple(w for w, f in enumerate(flags) if f == NONFINITE)
        got.left_out_here = transport.rank in got.nonfinite
        return got

    def _flags(self, gathered: list[torch.Tensor]) -> list[int]:
        """Every sender's validity flag, read from the device at once (PayloadError naming a
        sender whose flag is not one this run sends)."""
        if not gathered:
            return []
        read = torch.stack([g[-1] for g in gathered]).tolist()
        return [flag(v, w, self.deferred_checks) for w, v in enumerate(read)]

    def plan(self, shapes: list[torch.Size], device: torch.device) -> object | None:
        """The codec's plan for a whole bucket of ``shapes`` on ``device``, if it goes at once."""
        return batched.plan_for(self.codec, shapes, device)

    def defers(self, shapes: list[torch.Size], device: torch.device, compensated: bool) -> bool:
        """Where the bucket goes at once to a plain rule: the flag byte carries the device's
        finite check, and the combine's one read takes it with every sender's."""
        plan = self.plan(shapes, device)
        return plan is not None and batched.combines(plan, self.rule, None, None)

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """The codec's bytes per tensor, plus the flag byte."""
        return sum(self.codec.nbytes(s) for s in shapes) + 1

    def _sum_gathered(
        self,
        gathered: list[torch.Tensor],
        shapes: list[torch.Size],
        total_numel: int,
        weights: list[float] | None = None,
        out: torch.Tensor | None = None,
        me: int | None = None,
        flags: list[int] | None = None,
    ) -> Reduced:
        """The rule's combination of the gathered payloads (their validity ``flags``, if read
        already), written into ``out`` if given;
        weighted, with ``me`` (this worker) a sender, also what of its part the weights left
        unapplied (:meth:`~.combine.Combine.unapplied`)."""
        senders = []  # the workers that contributed
        flags = flags if flags is not None else self._flags(gathered)
        for w, payload in enumerate(gathered):
            self._check_len(payload[:-1], shapes, w)
            if flags[w] == SENT:
                senders.append(w)
        dev = gathered[0].device if gathered else None
        total = out if out is not None else torch.empty(total_numel, device=dev)
        if not senders:
            return Reduced(total.zero_(), 0)
        ws = [weights[w] for w in senders] if weights is not None else None
        asks = ws is not None or self.rule.restores  # unapplied() wanted of this merge
        mine = senders.index(me) if asks and me in senders else None
        unapplied = [] if mine is not None else None
        # tracked: each sender's squared norm, summed on the device, read once at the end
        sq = (
            {w: torch.zeros((), dtype=torch.float64, device=dev) for w in senders}
            if self.track
            else {}
        )
        left: dict[int, int] = {}  # tracked: each sender's elements the rule left out
        offset_b = offset_e = 0
        for i, shape in enumerate(shapes):
            nb, n = self.codec.nbytes(shape), numel(shape)
            pieces = [gathered[w][offset_b : offset_b + nb] for w in senders]
            names = [f"tensor {i} from worker {w}" for w in senders]
            # tracked: the per-sender norms below read the parts the rule decoded, not again
            parts = Parts(self.codec, pieces, shape, names, ws, senders, keep=self.track)
            try:
                self.rule.combine(parts, total[offset_e : offset_e + n])
            except PayloadError as err:
                raise parts.blame(err) from None
            if unapplied is not None and mine is not None:
                unapplied.append(self.rule.unapplied(parts, mine))
            if self.track:
                for j, w in enumerate(senders):
                    sq[w] += _squared_norm(parts, j)
                for j in getattr(self.rule, "excluded", []):
                    left[senders[j]] = left.get(senders[j], 0) + n
            offset_b += nb
            offset_e += n
        norms = {w: batched.inf_if_nan(float(v)) for w, v in sq.items()} if self.track else None
        for w, count in left.items():  # left out of most of what it sent: it offends
            if norms is not None and 2 * count > total_numel:
                norms[w] = float("inf")
        return Reduced(total, len(senders), unapplied, norms)

    def _decode_flat(
        self, payload: torch.Tensor, shapes: list[torch.Size], total_numel: int
    ) -> torch.Tensor:
        sparse = getattr(self.codec, "decode_sparse", None)
        # a sparse codec's decode is zeros + scatter: scatter straight into one zeroed buffer
        alloc = torch.zeros if sparse is not None else torch.empty
        out = alloc(total_numel, dtype=torch.float32, device=payload.device)
        ob = oe = 0
        for i, shape in enumerate(shapes):
            nb, n = self.codec.nbytes(shape), numel(shape)
            if sparse is not None:
                idx, vals = sparse(payload[ob : ob + nb], shape, f"tensor {i}")
                out[oe : oe + n].index_copy_(0, idx, vals)
            else:
                dec = self.codec.decode(payload[ob : ob + nb], shape, f"tensor {i}")
                out[oe : oe + n] = dec.reshape(-1)
            ob += nb
            oe += n
        return out

    def _check_len(self, payload: torch.Tensor, shapes: list[torch.Size], sender: int) -> None:
        want = sum(self.codec.nbytes(s) for s in shapes)
        if payload.numel() != want:
            raise PayloadError(
                f"payload from worker {sender} has {payload.numel()} bytes, expected {want}",
                sender,
            )


def _squared_norm(parts: Parts, j: int) -> torch.Tensor:
    """Part ``j``'s squared norm (FP64; a sparse codec's from the values it sent); inf for a
    part that does not decode (a robust rule dropped it)."""
    try:
        x = parts.sparse(j)[1] if hasattr(parts.codec, "decode_sparse") else parts[j]
    except PayloadError:
        return torch.tensor(float("inf"), dtype=torch.float64)
    return x.double().square().sum()
