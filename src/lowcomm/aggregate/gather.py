"""The gather exchange: every worker encodes each tensor, the packed payloads are all-gathered,
and each receiver decodes all M and sums them in FP32 (mean, or selected-mean for sparse codecs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs import _native
from ..codecs.base import Codec, PayloadError
from .base import Aggregator, Encoded, Reduced, check_selected_mean, contribution, flag, numel

if TYPE_CHECKING:
    from ..transport import Transport


def _fused_selected_mean(
    sent: list[tuple[torch.Tensor, torch.Tensor]],
    weights: list[float] | None,
    k: int,
    out: torch.Tensor,
) -> bool:
    """The selected mean of one tensor's sparse contributions (each a worker's indices,
    increasing within tiles of ``k``, and values) into ``out`` (zeroed) with the fused kernel:
    the same bits as index_add_ and a division; False where it is not available."""
    tensors = [t for pair in sent for t in pair]
    kernels = _native.usable(out, *tensors) if sent and k > 0 else None
    if kernels is None:
        return False
    w32 = torch.tensor(weights, dtype=torch.float32) if weights is not None else None
    return not kernels.lc_selected_mean(
        len(sent), _native.addresses([i for i, _ in sent]), _native.addresses([v for _, v in sent]),
        None if w32 is None else _native.ptr(w32), sent[0][0].numel(), k, _native.ptr(out),
    )  # fmt: skip


class GatherAggregator(Aggregator):
    """Averages by all-gathering every worker's encoded tensors and summing them in FP32.

    Exact for any codec and fine for small M; wire bytes grow as (M-1) x payload.
    ``aggregation="selected-mean"`` divides each element by how many workers sent it.
    """

    method = "gather"
    codec: Codec  # always set here (None only for all-reduce)

    def __init__(self, codec: Codec, world_size: int, aggregation: str = "mean") -> None:
        check_selected_mean(codec, aggregation)
        super().__init__(codec, world_size)
        self.aggregation = aggregation

    def encode(
        self,
        tensors: list[torch.Tensor],
        need_local: bool = False,
        valid: bool = True,
        key: str | None = None,
        slab: torch.Tensor | None = None,
        sparse_local: bool = False,
    ) -> Encoded:
        """Each tensor encoded, then one flag byte (see :meth:`Aggregator.encode`)."""
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
        """All-gather the payloads, decode each and sum in FP32 (weighted: see
        :meth:`Aggregator.exchange`)."""
        gathered = self._timed(transport.all_gather, enc.payload)
        return self._sum_gathered(gathered, enc.shapes, enc.numel, weights, enc.out)

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
    ) -> Reduced:
        """The mean of the gathered payloads, written into ``out`` if given."""
        dev = gathered[0].device if gathered else None
        senders, sent_weights = [], []  # the workers that contributed, and their weights
        for w, payload in enumerate(gathered):
            self._check_len(payload[:-1], shapes, f"worker {w}")
            if flag(payload[-1], f"worker {w}"):
                senders.append(w)
                sent_weights.append(weights[w] if weights is not None else 1.0)
        if self.aggregation == "selected-mean":
            return self._selected_mean(gathered, shapes, total_numel, senders, weights, out)
        total = out if out is not None else torch.empty(total_numel, device=dev)
        if not senders:
            return Reduced(total.zero_(), 0)
        divisor = sum(sent_weights) if weights is not None else len(senders)
        divisor = divisor if divisor > 0 else 1.0
        ws = sent_weights if weights is not None else None
        fused = getattr(self.codec, "decode_mean", None)
        offset_b = offset_e = 0
        for i, shape in enumerate(shapes):
            nb, n = self.codec.nbytes(shape), numel(shape)
            pieces = [gathered[w][offset_b : offset_b + nb] for w in senders]
            names = [f"tensor {i} from worker {w}" for w in senders]
            mean = total[offset_e : offset_e + n]
            if fused is None or not fused(pieces, shape, mean, ws, divisor, names):
                mean.zero_()
                for piece, name, weight in zip(pieces, names, sent_weights):
                    dec = self.codec.decode(piece, shape, name)
                    mean += dec.reshape(-1) * weight if weights is not None else dec.reshape(-1)
                mean.div_(divisor)
            offset_b += nb
            offset_e += n
        return Reduced(total, len(senders))

    def _selected_mean(
        self,
        gathered: list[torch.Tensor],
        shapes: list[torch.Size],
        total_numel: int,
        senders: list[int],
        weights: list[float] | None,
        out: torch.Tensor | None = None,
    ) -> Reduced:
        """Each entry averaged over the workers that sent it (weighted: by their weights)."""
        dev = gathered[0].device if gathered else None
        if out is not None:
            total = out.zero_()
        else:
            total = torch.zeros(total_numel, dtype=torch.float32, device=dev)
        # counts (only where no fused kernel runs) are small integers, exact in any dtype:
        # int16 halves the model-sized buffer
        count_dtype = (
            torch.float32 if weights else torch.int16 if len(gathered) < 2**15 else torch.int32
        )
        counts: torch.Tensor | None = None
        touched: list[torch.Tensor] = []  # where some worker sent a value
        sparse = self.codec.decode_sparse  # type: ignore[attr-defined]
        k = getattr(self.codec, "geometry", None)
        offset_b = offset_e = 0
        for i, shape in enumerate(shapes):
            nb, n = self.codec.nbytes(shape), numel(shape)
            name = f"tensor {i} from worker {{}}"
            sent = [
                sparse(gathered[w][offset_b : offset_b + nb], shape, name.format(w))
                for w in senders
            ]
            mean = total[offset_e : offset_e + n]
            ws = [weights[w] for w in senders] if weights is not None else None
            if not _fused_selected_mean(sent, ws, k(shape).k if k else 0, mean):
                if counts is None:
                    counts = torch.zeros(total_numel, dtype=count_dtype, device=dev)
                for (idx, vals), weight in zip(sent, ws or [1.0] * len(sent)):
                    if weights is not None:
                        vals = vals * weight
                    mean.index_add_(0, idx, vals)
                    ones = torch.full_like(idx, weight, dtype=counts.dtype)
                    counts[offset_e : offset_e + n].index_add_(0, idx, ones)
                    touched.append(idx + offset_e)
            offset_b += nb
            offset_e += n
        # divide only where something was sent: elsewhere the total is 0, and 0 / 1 = 0
        # (repeated positions write the same quotient)
        if touched:
            at = torch.cat(touched)
            total.index_copy_(0, at, total[at] / counts[at])
        return Reduced(total, len(senders))

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

    def _check_len(self, payload: torch.Tensor, shapes: list[torch.Size], who: str) -> None:
        want = sum(self.codec.nbytes(s) for s in shapes)
        if payload.numel() != want:
            raise PayloadError(f"payload from {who} has {payload.numel()} bytes, expected {want}")
