"""The all-reduce exchange: a dense codec (fp32/bf16/fp16) casts the flat buffer and
all-reduces it, the validity flag riding along as one more element."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import Aggregator, Encoded, Reduced, contribution, numel, scaled_unapplied
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
        tensors: list[torch.Tensor],
        need_local: bool = False,
        valid: bool = True,
        key: str | None = None,
        slab: torch.Tensor | None = None,
        sparse_local: bool = False,
        flat: torch.Tensor | None = None,
    ) -> Encoded:
        """The tensors and the flag, cast, in one flat payload (see :meth:`Aggregator.encode`);
        in FP32 the ``slab``, if given, is the payload."""
        if slab is not None and self.dense_dtype == torch.float32:
            if not valid:
                slab.zero_()
            slab[-1] = float(valid)
            local = slab[:-1] if need_local else None
            return Encoded(slab, [t.shape for t in tensors], slab.numel() - 1, local, key)
        tensors, shapes, n = contribution(tensors, valid)
        like = tensors[0] if tensors else torch.empty(0)
        flag = like.new_full((1,), float(valid))
        # one copy: the tensors and the flag straight into the payload
        payload = torch.cat([t.reshape(-1) for t in tensors] + [flag]).to(self.dense_dtype)
        local = payload[:-1].float() if need_local else None
        return Encoded(payload, shapes, n, local, key)

    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """All-reduce, then the rule finishes the sum with the summed flags (weighted: each
        worker scales its payload and flag by its weight first, so the flags sum to the total
        weight).

        The all-reduce sums ``enc.payload`` in place (a model-sized copy saved) unless
        ``enc.local`` was asked for, which may share its memory.
        """
        buf = enc.payload.clone() if enc.local is not None else enc.payload
        if weights is not None:
            buf.mul_(weights[transport.rank])
        self._timed(transport.all_reduce, buf)
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
