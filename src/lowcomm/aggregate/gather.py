"""The gather exchange: every worker encodes each tensor, the packed payloads are all-gathered,
and each receiver decodes all M and sums them in FP32 (mean, or selected-mean for sparse codecs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..codecs.base import Codec, PayloadError
from .base import Aggregator, Encoded, Reduced, check_selected_mean, contribution, flag, numel

if TYPE_CHECKING:
    from ..transport import Transport


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
    ) -> Encoded:
        """Each tensor encoded, then one flag byte (see :meth:`Aggregator.encode`)."""
        tensors, shapes, n = contribution(tensors, valid)
        parts = [self.codec.encode(t) for t in tensors]
        flag_byte = torch.tensor(
            [int(valid)], dtype=torch.uint8, device=parts[0].device if parts else None
        )
        payload = torch.cat(parts + [flag_byte])
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
        return self._sum_gathered(gathered, enc.shapes, enc.numel, weights)

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """The codec's bytes per tensor, plus the flag byte."""
        return sum(self.codec.nbytes(s) for s in shapes) + 1

    def _sum_gathered(
        self,
        gathered: list[torch.Tensor],
        shapes: list[torch.Size],
        total_numel: int,
        weights: list[float] | None = None,
    ) -> Reduced:
        dev = gathered[0].device if gathered else None
        total = torch.zeros(total_numel, dtype=torch.float32, device=dev)
        selected = self.aggregation == "selected-mean"
        if selected:
            # counts are small integers, exact in any dtype: int16 halves the model-sized buffer
            small = len(gathered) < 2**15
            count_dtype = torch.int16 if small else torch.int32
            counts = torch.zeros(
                total_numel, dtype=torch.float32 if weights else count_dtype, device=dev
            )
            touched: list[torch.Tensor] = []  # where some worker sent a value
        valid, weight_sum = 0, 0.0
        for w, payload in enumerate(gathered):
            offset_b, offset_e = 0, 0
            self._check_len(payload[:-1], shapes, f"worker {w}")
            if not flag(payload[-1], f"worker {w}"):
                continue
            valid += 1
            weight = weights[w] if weights is not None else 1.0
            weight_sum += weight
            for i, shape in enumerate(shapes):
                nb = self.codec.nbytes(shape)
                n = numel(shape)
                piece = payload[offset_b : offset_b + nb]
                name = f"tensor {i} from worker {w}"
                if selected:
                    sparse = self.codec.decode_sparse  # type: ignore[attr-defined]
                    idx, vals = sparse(piece, shape, name)
                    if weights is not None:
                        vals = vals * weight
                    total[offset_e : offset_e + n].index_add_(0, idx, vals)
                    ones = torch.full_like(idx, weight, dtype=counts.dtype)
                    counts[offset_e : offset_e + n].index_add_(0, idx, ones)
                    touched.append(idx + offset_e)
                else:
                    dec = self.codec.decode(piece, shape, name)
                    if weights is not None:
                        dec = dec * weight
                    total[offset_e : offset_e + n] += dec.reshape(-1)
                offset_b += nb
                offset_e += n
        if selected:
            # divide only where something was sent: elsewhere the total is 0, and 0 / 1 = 0
            # (repeated positions write the same quotient)
            if touched:
                at = torch.cat(touched)
                total.index_copy_(0, at, total[at] / counts[at])
            return Reduced(total, valid)
        if weights is not None:
            return Reduced(total.div_(weight_sum if weight_sum > 0 else 1.0), valid)
        return Reduced(total.div_(max(valid, 1)), valid)

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
