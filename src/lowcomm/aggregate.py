"""Turn every worker's contribution into one averaged tensor: encode, exchange, decode, FP32 sum.

Three ways, chosen by ``SyncConfig.reduce``:

- ``allreduce``: dense codecs (fp32/bf16/fp16) cast the flat buffer and all-reduce it.
- ``gather``: every worker encodes each tensor, the packed payloads are all-gathered, and each
  receiver decodes all M payloads and sums them in FP32 (never in the low-bit format). Exact for
  any codec and fine for small M; wire bytes grow as (M-1) x payload.
- ``two-phase``: the flat buffer is cut into M shards (each a whole number of the codec's scale
  blocks, so a block never straddles two owners); each shard is encoded and sent to its owner by
  all-to-all; the owner decodes and sums its shard in FP32, re-encodes the average and
  all-gathers it. Wire bytes stay about 2 x payload whatever M is. Element-wise codecs only.
  The re-encode is a second lossy quantisation: with ``reduce_compensation`` (LoCo's
  moving average, or error feedback) it is compensated like the first, with its own buffer
  for the shard this worker owns, keyed by the ``key`` given to ``encode`` (docs/algorithms.md,
  LoCo). ``reduce_scatter`` stops after the first phase (FSDP needs only that half).

Every payload carries one extra element or byte: 1 if this worker's contribution is valid, 0
if it was left out (a non-finite pseudo-gradient). The average divides by the number of valid
workers, which every worker learns from the same exchange, with no extra collective.

The math lives here; the bytes move through :class:`~lowcomm.transport.Transport`.
``encode`` runs on the compute thread (it is also what error compensation needs to see), and
``exchange`` is the blocking part that may run on the transport's comm thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .codecs.base import Codec, PayloadError
from .config import DENSE_CODECS, SyncConfig

if TYPE_CHECKING:  # the math never calls the transport's module, only the object handed in
    from .compensation import Compensation
    from .transport import Transport

T = TypeVar("T")
_DENSE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Encoded:
    """What one worker contributes to one exchange."""

    payload: torch.Tensor  # what the first collective gets (flag included)
    shapes: list[torch.Size]  # the shapes of the tensors it encodes, in order
    numel: int  # total elements
    local: torch.Tensor | None  # flat FP32 of what peers will decode from us (for compensation)
    key: str | None = None  # names the reduce-side compensation buffer (two-phase)
    shard_numel: int = 0  # two-phase: elements per worker's shard


@dataclass
class Reduced:
    """The result of one exchange."""

    mean: torch.Tensor  # flat FP32 average over the valid workers
    valid_workers: int  # how many workers contributed


class Aggregator:
    """Averages flat groups of tensors across workers through a codec and a collective."""

    def __init__(
        self,
        method: str,
        codec: Codec | None,
        world_size: int,
        aggregation: str = "mean",
        dense_dtype: torch.dtype = torch.float32,
        reduce_compensation: Compensation | None = None,
    ) -> None:
        if method not in ("allreduce", "gather", "two-phase"):
            raise ValueError(f"unknown reduce method {method}")
        if method != "allreduce" and codec is None:
            raise ValueError(f"reduce={method} needs a codec")
        if method == "two-phase" and codec is not None and not codec.elementwise:
            raise ValueError(f"codec {codec.name} is not element-wise: use reduce=gather")
        if aggregation == "selected-mean" and not hasattr(codec, "decode_sparse"):
            raise ValueError("aggregation=selected-mean needs a sparse codec (codec=topk)")
        self.method, self.codec, self.world_size = method, codec, world_size
        self.aggregation = aggregation
        self.dense_dtype = dense_dtype
        # only the two-phase reduce quantises twice; elsewhere there is nothing to compensate
        self.reduce_compensation = reduce_compensation if method == "two-phase" else None
        # seconds inside the collectives of exchange(): the rest of it is decoding and summing
        self.collective_s = 0.0

    # -- encode (compute thread) -----------------------------------------------------------------
    def encode(
        self,
        tensors: list[torch.Tensor],
        need_local: bool = False,
        valid: bool = True,
        key: str | None = None,
    ) -> Encoded:
        """Encode ``tensors`` (FP32, any shapes); ``need_local`` also returns our decoded view.

        ``valid=False`` sends zeros flagged as "left out": peers average without this worker.
        ``key`` names this group's reduce-side compensation buffer (the same key for the same
        tensors every step); without one the second quantisation is not compensated.
        """
        if not valid:
            tensors = [torch.zeros_like(t) for t in tensors]
        shapes = [t.shape for t in tensors]
        numel = sum(t.numel() for t in tensors)
        if self.method == "allreduce":
            like = tensors[0] if tensors else torch.empty(0)
            flag = like.new_full((1,), float(valid))
            # one copy: the tensors and the flag straight into the payload
            payload = torch.cat([t.reshape(-1) for t in tensors] + [flag]).to(self.dense_dtype)
            local = payload[:-1].float() if need_local else None
            return Encoded(payload, shapes, numel, local, key)
        assert self.codec is not None
        if self.method == "gather":
            parts = [self.codec.encode(t) for t in tensors]
            flag = torch.tensor(
                [int(valid)], dtype=torch.uint8, device=parts[0].device if parts else None
            )
            payload = torch.cat(parts + [flag])
            local = None
            if need_local:
                local = self._decode_flat(payload[:-1], shapes, numel)
            return Encoded(payload, shapes, numel, local, key)
        # two-phase: shard the flat buffer, one payload per destination worker
        flat = torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.empty(0)
        enc = self.encode_shards(self._shards(flat), need_local, valid, key)
        enc.shapes, enc.numel = shapes, numel
        if enc.local is not None:
            enc.local = enc.local[:numel]
        return enc

    def encode_shards(
        self,
        shards: torch.Tensor,
        need_local: bool = False,
        valid: bool = True,
        key: str | None = None,
    ) -> Encoded:
        """Two-phase encode of ``shards`` (M x n, FP32), row j for worker j: FSDP's own layout."""
        assert self.codec is not None and self.method == "two-phase"
        if shards.shape[0] != self.world_size:
            raise ValueError(
                f"need one shard per worker ({self.world_size}), got {shards.shape[0]}"
            )
        if not valid:
            shards = torch.zeros_like(shards)
        flag = torch.tensor([[int(valid)]], dtype=torch.uint8, device=shards.device)
        packed = torch.stack([self.codec.encode(s) for s in shards.unbind(0)])
        payload = torch.cat([packed, flag.expand(len(packed), 1)], dim=1)
        local = None
        if need_local:
            shape = shards[0].shape
            local = torch.cat(
                [self.codec.decode(p, shape, f"shard {j}") for j, p in enumerate(packed)]
            )
        return Encoded(payload, [shards.shape], shards.numel(), local, key, shards.shape[1])

    # -- exchange (may run on the comm thread) ---------------------------------------------------
    def exchange(self, enc: Encoded, transport: Transport) -> Reduced:
        """Run the collectives and return the flat FP32 average over the valid workers.

        The all-reduce sums ``enc.payload`` in place (a model-sized copy saved) unless
        ``enc.local`` was asked for, which may share its memory.
        """
        if self.method == "allreduce":
            buf = enc.payload.clone() if enc.local is not None else enc.payload
            self._timed(transport.all_reduce, buf)
            count = int(round(float(buf[-1])))
            return Reduced(buf[:-1].float().div_(max(count, 1)), count)
        if self.method == "gather":
            gathered = self._timed(transport.all_gather, enc.payload)
            return self._sum_gathered(gathered, enc.shapes, enc.numel)
        return self._two_phase(enc, transport)

    def reduce_scatter(self, enc: Encoded, transport: Transport) -> Reduced:
        """Two-phase, first half only: the FP32 average of this worker's shard (one quantisation).

        The shard's length is ``enc.shard_numel``; FSDP's reduce-scatter is exactly this.
        """
        assert self.codec is not None and self.method == "two-phase"
        received = self._timed(transport.all_to_all, list(enc.payload.unbind(0)))
        shape = torch.Size([enc.shard_numel])
        mine = torch.zeros(shape, dtype=torch.float32, device=enc.payload.device)
        valid = 0
        for w, p in enumerate(received):
            if _flag(p[-1], f"worker {w}"):
                mine += self.codec.decode(p[:-1], shape, f"shard {transport.rank} from worker {w}")
                valid += 1
        return Reduced(mine.div_(max(valid, 1)), valid)

    def _timed(self, collective: Callable[[Any], T], arg: Any) -> T:
        """Run one of the transport's collectives, adding its time to ``collective_s``."""
        t0 = time.perf_counter()
        try:
            return collective(arg)
        finally:
            self.collective_s += time.perf_counter() - t0

    def step(self) -> None:
        """Count one optimizer step for the reduce-side buffers (their periodic reset).

        Call it when no exchange is in flight, or queue it on the comm thread after them.
        """
        if self.reduce_compensation is not None:
            self.reduce_compensation.step()

    def _sum_gathered(
        self, gathered: list[torch.Tensor], shapes: list[torch.Size], numel: int
    ) -> Reduced:
        assert self.codec is not None
        dev = gathered[0].device if gathered else None
        total = torch.zeros(numel, dtype=torch.float32, device=dev)
        if self.aggregation == "selected-mean":
            # counts are small integers, exact in any dtype: int16 halves the model-sized buffer
            small = len(gathered) < 2**15
            counts = torch.zeros(numel, dtype=torch.int16 if small else torch.int32, device=dev)
            touched: list[torch.Tensor] = []  # where some worker sent a value
        valid = 0
        for w, payload in enumerate(gathered):
            offset_b, offset_e = 0, 0
            self._check_len(payload[:-1], shapes, f"worker {w}")
            if not _flag(payload[-1], f"worker {w}"):
                continue
            valid += 1
            for i, shape in enumerate(shapes):
                nb = self.codec.nbytes(shape)
                n = _numel(shape)
                piece = payload[offset_b : offset_b + nb]
                name = f"tensor {i} from worker {w}"
                if self.aggregation == "selected-mean":
                    sparse = self.codec.decode_sparse  # type: ignore[attr-defined]
                    idx, vals = sparse(piece, shape, name)
                    total[offset_e : offset_e + n].index_add_(0, idx, vals)
                    ones = torch.ones_like(idx, dtype=counts.dtype)
                    counts[offset_e : offset_e + n].index_add_(0, idx, ones)
                    touched.append(idx + offset_e)
                else:
                    dec = self.codec.decode(piece, shape, name)
                    total[offset_e : offset_e + n] += dec.reshape(-1)
                offset_b += nb
                offset_e += n
        if self.aggregation == "selected-mean":
            # divide only where something was sent: elsewhere the total is 0, and 0 / 1 = 0
            # (repeated positions write the same quotient)
            if touched:
                at = torch.cat(touched)
                total.index_copy_(0, at, total[at] / counts[at])
            return Reduced(total, valid)
        return Reduced(total.div_(max(valid, 1)), valid)

    def _two_phase(self, enc: Encoded, transport: Transport) -> Reduced:
        assert self.codec is not None
        red = self.reduce_scatter(enc, transport)
        mine, comp = red.mean, self.reduce_compensation
        # a left-out worker changes nothing here (every owner averages the valid ones alike);
        # with no valid worker at all there is nothing to compensate
        use = comp is not None and enc.key is not None and red.valid_workers > 0
        key = f"{enc.key}/reduced shard" if use else None
        h = comp.before_send(key, mine) if key is not None else mine
        payload = self.codec.encode(h)
        if key is not None:
            comp.after_send(key, h, self.codec.decode(payload, h.shape, "own averaged shard"))
        gathered = self._timed(transport.all_gather, payload)
        shape = mine.shape
        out = torch.cat(
            [self.codec.decode(p, shape, f"averaged shard {w}") for w, p in enumerate(gathered)]
        )
        return Reduced(out[: enc.numel], red.valid_workers)

    # -- helpers -------------------------------------------------------------------------------
    def _shard_len(self, numel: int) -> int:
        """Elements per two-phase shard: a whole number of the codec's scale blocks."""
        n = _shard_len(numel, self.world_size)
        block = getattr(self.codec, "block_size", 1)
        return -(-n // block) * block

    def _shards(self, flat: torch.Tensor) -> torch.Tensor:
        m = self.world_size
        n = self._shard_len(flat.numel())
        padded = torch.zeros(n * m, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        return padded.view(m, n)

    def _decode_flat(
        self, payload: torch.Tensor, shapes: list[torch.Size], numel: int
    ) -> torch.Tensor:
        assert self.codec is not None
        sparse = getattr(self.codec, "decode_sparse", None)
        # a sparse codec's decode is zeros + scatter: scatter straight into one zeroed buffer
        alloc = torch.zeros if sparse is not None else torch.empty
        out = alloc(numel, dtype=torch.float32, device=payload.device)
        ob = oe = 0
        for i, shape in enumerate(shapes):
            nb, n = self.codec.nbytes(shape), _numel(shape)
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
        assert self.codec is not None
        want = sum(self.codec.nbytes(s) for s in shapes)
        if payload.numel() != want:
            raise PayloadError(f"payload from {who} has {payload.numel()} bytes, expected {want}")

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """Bytes this worker hands to the first collective for tensors of ``shapes`` (with flag)."""
        numel = sum(_numel(s) for s in shapes)
        if self.method == "allreduce":
            return (numel + 1) * torch.tensor([], dtype=self.dense_dtype).element_size()
        assert self.codec is not None
        if self.method == "gather":
            return sum(self.codec.nbytes(s) for s in shapes) + 1
        return self.world_size * (self.codec.nbytes(torch.Size([self._shard_len(numel)])) + 1)


def _flag(byte: torch.Tensor, who: str) -> bool:
    v = int(byte)
    if v not in (0, 1):
        raise PayloadError(f"payload from {who} has validity flag {v}, expected 0 or 1")
    return v == 1


def _numel(shape: torch.Size) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _shard_len(numel: int, m: int) -> int:
    return -(-numel // m) if numel else 0


def make_aggregator(cfg: SyncConfig, world_size: int) -> Aggregator:
    """The aggregator for a config: resolves reduce=auto and builds the codec."""
    method = cfg.reduce
    if method == "auto":
        method = "allreduce" if cfg.codec in DENSE_CODECS else "gather"
    if method == "allreduce":
        return Aggregator("allreduce", None, world_size, dense_dtype=_DENSE_DTYPES[cfg.codec])
    from .codecs import make_codec  # the codec registry

    codec = make_codec(
        cfg.codec, block_size=cfg.codec_block, density=cfg.density, value_bits=cfg.value_bits
    )
    reduce_comp = _reduce_compensation(cfg) if method == "two-phase" else None
    return Aggregator(
        method,
        codec,
        world_size,
        aggregation=cfg.resolved_aggregation,
        reduce_compensation=reduce_comp,
    )


def _reduce_compensation(cfg: SyncConfig) -> Compensation | None:
    """The second quantisation is compensated by the same rule as the first (its own buffers)."""
    from .compensation import ErrorFeedback, MovingAverageCompensation

    if cfg.compensation == "ef":
        return ErrorFeedback(cfg.error_decay, device=None)
    if cfg.compensation == "loco":
        return MovingAverageCompensation(
            cfg.loco_beta, device=None, reset_every=cfg.loco_reset_every
        )
    return None


def encode_compensated(
    aggregator: Aggregator,
    compensation: Compensation | None,
    names: list[str],
    tensors: list[torch.Tensor],
    valid: bool = True,
    key: str | None = None,
) -> Encoded:
    """Compensate, encode and record the loss of one group of named tensors (one collective).

    Per tensor: ``x' = before_send(name, x)``; the group is encoded; then ``after_send(name, x',
    what peers decode of x')``. A group that is not ``valid`` goes out flagged as left out and
    leaves the buffers alone (a non-finite gradient must not pollute them).
    """
    comp = compensation if valid else None
    to_send = [comp.before_send(n, t) for n, t in zip(names, tensors)] if comp else list(tensors)
    enc = aggregator.encode(to_send, need_local=comp is not None, valid=valid, key=key)
    if comp is not None:
        assert enc.local is not None
        offset = 0
        for n, h in zip(names, to_send):
            comp.after_send(n, h, enc.local[offset : offset + h.numel()].view_as(h))
            offset += h.numel()
    return enc
