"""The two-phase exchange: shard, all-to-all, each owner sums its shard in FP32, re-encodes the
average (compensated when asked) and all-gathers it. Wire bytes stay about 2 x payload at any M.

The flat buffer is cut into M shards, each a whole number of the codec's scale blocks so a
block never straddles two owners, hence element-wise codecs only. The re-encode is a second
lossy quantisation: with ``reduce_compensation`` (LoCo's moving average, or error feedback) it
is compensated like the first, with its own buffer for the shard this worker owns, keyed by the
``key`` given to ``encode`` (docs/algorithms.md, LoCo). ``reduce_scatter`` stops after the first
phase (FSDP needs only that half).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs.base import Codec
from ..errors import PayloadError
from .base import (
    SENT,
    Aggregator,
    Encoded,
    Reduced,
    contribution,
    flag,
    numel,
    scaled_unapplied,
)
from .combine import Combine, Parts

if TYPE_CHECKING:
    from ..compensation import Compensation
    from ..transport import Transport


class TwoPhaseAggregator(Aggregator):
    """Combines by reduce-scatter (all-to-all of encoded shards, each owner combining its shard
    by the rule) then all-gather of the combined shards. The codec must be element-wise (the
    config checks it) and the rule a sum (a shard's sum is the sum's shard)."""

    method = "two-phase"
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

    # -- encode (compute thread) -----------------------------------------------------------------
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
        """Shard the flat buffer, one payload per destination worker (see
        :meth:`Aggregator.encode`)."""
        tensors, shapes, n = contribution(tensors, valid)
        flat = torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.empty(0)
        enc = self.encode_shards(self._shards(flat), need_local, valid, key)
        enc.shapes, enc.numel = shapes, n
        if enc.local is not None:
            enc.local = enc.local[:n]
        return enc

    def encode_shards(
        self,
        shards: torch.Tensor,
        need_local: bool = False,
        valid: bool = True,
        key: str | None = None,
    ) -> Encoded:
        """Two-phase encode of ``shards`` (M x n, FP32), row j for worker j: FSDP's own layout."""
        if shards.shape[0] != self.world_size:
            raise ValueError(
                f"need one shard per worker ({self.world_size}), got {shards.shape[0]}"
            )
        if not valid:
            shards = torch.zeros_like(shards)
        flag_byte = torch.tensor([[int(valid)]], dtype=torch.uint8, device=shards.device)
        packed = torch.stack([self.codec.encode(s) for s in shards.unbind(0)])
        payload = torch.cat([packed, flag_byte.expand(len(packed), 1)], dim=1)
        local = None
        if need_local:
            shape = shards[0].shape
            local = torch.cat(
                [self.codec.decode(p, shape, f"shard {j}") for j, p in enumerate(packed)]
            )
        return Encoded(payload, [shards.shape], shards.numel(), local, key, shards.shape[1])

    # -- exchange (may run on the comm thread) ---------------------------------------------------
    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """Reduce-scatter, re-encode this worker's averaged shard, all-gather every shard
        (weighted: see :meth:`Aggregator.exchange`)."""
        red = self.reduce_scatter(enc, transport, weights)
        mine, comp = red.mean, self.reduce_compensation
        # a left-out worker changes nothing here (every owner averages the valid ones alike);
        # with no valid worker at all there is nothing to compensate
        use = comp is not None and enc.key is not None and red.valid_workers > 0
        key = f"{enc.key}/reduced shard" if use else None
        h = comp.before_send(key, mine) if key is not None and comp is not None else mine
        payload = self.codec.encode(h)
        if key is not None and comp is not None:
            comp.after_send(key, h, self.codec.decode(payload, h.shape, "own averaged shard"))
        gathered = self._timed(transport.all_gather, payload)
        shape = mine.shape
        out = torch.cat([self._averaged(p, shape, w) for w, p in enumerate(gathered)])
        unapplied = scaled_unapplied(self.rule, enc, weights, transport.rank)
        return Reduced(out[: enc.numel], red.valid_workers, unapplied)

    def _averaged(self, payload: torch.Tensor, shape: torch.Size, owner: int) -> torch.Tensor:
        """Worker ``owner``'s averaged shard, decoded (a bad one names its owner)."""
        try:
            return self.codec.decode(payload, shape, f"averaged shard {owner}")
        except PayloadError as err:
            raise PayloadError(str(err), owner) from None

    def reduce_scatter(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """Two-phase, first half only: the rule's FP32 combination of this worker's shard (one
        quantisation).

        The shard's length is ``enc.shard_numel``; FSDP's reduce-scatter is exactly this.
        """
        received = self._timed(transport.all_to_all, list(enc.payload.unbind(0)))
        shape = torch.Size([enc.shard_numel])
        mine = torch.zeros(shape, dtype=torch.float32, device=enc.payload.device)
        senders = [w for w, p in enumerate(received) if flag(p[-1], w) == SENT]
        if senders:
            parts = Parts(
                self.codec,
                [received[w][:-1] for w in senders],
                shape,
                [f"shard {transport.rank} from worker {w}" for w in senders],
                [weights[w] for w in senders] if weights is not None else None,
                senders,
            )
            try:
                self.rule.combine(parts, mine)
            except PayloadError as err:
                raise parts.blame(err) from None
        return Reduced(mine, len(senders))

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """M shard payloads, each with its flag byte."""
        total = sum(numel(s) for s in shapes)
        return self.world_size * (self.codec.nbytes(torch.Size([self._shard_len(total)])) + 1)

    # -- helpers -------------------------------------------------------------------------------
    def _shard_len(self, total: int) -> int:
        """Elements per shard: a whole number of the codec's scale blocks."""
        n = -(-total // self.world_size) if total else 0
        block = getattr(self.codec, "block_size", 1)
        return -(-n // block) * block

    def _shards(self, flat: torch.Tensor) -> torch.Tensor:
        m = self.world_size
        n = self._shard_len(flat.numel())
        padded = torch.zeros(n * m, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        return padded.view(m, n)
