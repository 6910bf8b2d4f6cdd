"""The all-reduce exchange: a dense codec (fp32/bf16/fp16) casts the fragment's flat buffer and
all-reduces it bucket by bucket, the validity flag riding along as one more element after the
last bucket's values."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import Aggregator, Encoded, Reduced, Valid, numel, scaled_unapplied, tensor_splits
from .combine import Combine, SumCombine

if TYPE_CHECKING:
    from ..transport import Transport


class AllReduceAggregator(Aggregator):
    """Casts to ``dense_dtype``, sums with one all-reduce (no codec) and lets the rule (a sum
    rule, the mean by default) finish the sum."""

    method = "allreduce"
    rule: SumCombine  # checked in Aggregator.__init__

    def __init__(
        self,
        world_size: int,
        dense_dtype: torch.dtype = torch.float32,
        aggregation: str | Combine = "mean",
    ) -> None:
        super().__init__(None, world_size, aggregation)
        self.dense_dtype = dense_dtype

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
        """The fragment and the flag, cast, in one flat payload (see :meth:`Aggregator.encode`);
        in FP32 the ``slab``, if given, is the payload. Each bucket's collective sums its
        slice of the payload, the last one's with the flag."""
        assert not isinstance(valid, torch.Tensor), "an all-reduce reads its check first"
        n = flat.numel()
        edges = tensor_splits(shapes, buckets)
        starts = [0]
        for s in shapes:
            starts.append(starts[-1] + numel(s))
        splits = [starts[e] for e in edges[:-1]] + [n + 1]
        if slab is not None and self.dense_dtype == torch.float32:
            if not valid:
                slab.zero_()
            slab[-1] = float(valid)
            local = slab[:-1] if want else None
            return Encoded(slab, list(shapes), n, local, key, splits)
        payload = torch.empty(n + 1, dtype=self.dense_dtype, device=flat.device)
        if valid:
            payload[:-1].copy_(flat)  # one copy: the values cast straight into the payload
        else:
            payload[:-1].zero_()
        payload[-1] = float(valid)
        local = payload[:-1].float() if want else None
        return Encoded(payload, list(shapes), n, local, key, splits)

    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """All-reduce bucket by bucket, then the rule finishes the sum with the summed flags
        (weighted: each worker scales its payload and flag by its weight first, so the flags
        sum to the total weight).

        The all-reduce sums ``enc.payload`` in place (a model-sized copy saved) unless
        ``enc.local`` was asked for, which may share its memory.
        """
        buf = enc.payload.clone() if enc.local is not None else enc.payload
        if weights is not None:
            buf.mul_(weights[transport.rank])
        s = enc.splits
        for lo, hi in zip(s, s[1:]):
            self._timed(transport.all_reduce, buf[lo:hi])
        if weights is not None:
            valid = sum(1 for w in weights if w > 0)
            mean = self.rule.finish(buf[:-1].float(), float(buf[-1]))
            return Reduced(mean, valid, scaled_unapplied(self.rule, enc, weights, transport.rank))
        # the summed flags hold the count; the control flags told it already where they can
        count = enc.senders if enc.senders is not None else int(round(float(buf[-1])))
        return Reduced(self.rule.finish(buf[:-1].float(), count), count)

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """``(numel + 1)`` elements of ``dense_dtype``."""
        total = sum(numel(s) for s in shapes)
        return (total + 1) * torch.tensor([], dtype=self.dense_dtype).element_size()
