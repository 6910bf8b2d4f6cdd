"""Per-step gradient reduction for data-parallel training: DDP communication hooks.

``allreduce_hook`` is the plain FP32 baseline (DDP's own behaviour, but metered by lowcomm's
byte meter and timed, so DDP and the low-communication methods are measured the same way).
LoCo's compressed hook will live here as well (ALGORITHMS.md §5).
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import time

import torch
import torch.distributed as dist

from .transport import Transport


class GradReduceState:
    """State of a DDP comm hook: the metered transport and the time the last bucket was launched.

    The last bucket is launched when backward's own compute ends; whatever backward spends
    after that is waiting on the network, which is how the trainer measures DDP's blocked time.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.last_launch: float = 0.0
        self.buckets: int = 0


def allreduce_hook(state: GradReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """FP32 mean all-reduce of one DDP bucket, counted by the transport's byte meter."""
    state.last_launch = time.perf_counter()
    state.buckets += 1
    buf = bucket.buffer()
    buf.div_(state.transport.world_size)
    return state.transport.all_reduce_async(buf)


class LoCoState(GradReduceState):
    """State of the LoCo hook (ALGORITHMS.md §5): codec, compensation buffers, aggregator.

    Compensation buffers are keyed by parameter *name* (DDP rebuilds its buckets after the first
    iteration, so bucket indices are not stable), stored in ``storage_dtype`` on ``state_device``.

    Reduction: for M <= 2 an all-gather of the 4-bit payloads with an FP32 sum (one quantization,
    and the same wire bytes as the two-phase reduce at M = 2); for M >= 3 the two-phase reduce
    (all-to-all of 4-bit shards, FP32 sum, re-encode, all-gather), whose wire bytes per worker
    stay about 2 x payload however large M grows, where the all-gather's grow as (M-1) x payload.
    ``reduce`` forces one or the other.
    """

    def __init__(self, model: torch.nn.Module, transport: Transport | None = None, bits: int = 4,
                 beta: float = 0.8, group_size: int = 128, reset_every: int = 0,
                 storage_dtype: torch.dtype = torch.float32, reduce: str = "auto",
                 compensate: bool = True, state_device: str = "cpu") -> None:
        from .aggregate import Aggregator
        from .codecs import make_codec
        from .compensation import MovingAverageCompensation

        super().__init__(transport if transport is not None else Transport())
        module = getattr(model, "module", model)  # accept the DDP wrapper or the bare model
        self.name_of = {id(p): n for n, p in module.named_parameters()}
        if bits not in (2, 4, 8):
            raise ValueError(f"LoCo bits must be 2, 4 or 8, got {bits}")
        m = self.transport.world_size
        method = reduce if reduce != "auto" else ("gather" if m <= 2 else "two-phase")
        self.codec = make_codec(f"int{bits}", block_size=group_size)
        self.aggregator = Aggregator(method, self.codec, m)
        self.compensation = (MovingAverageCompensation(beta, dtype=storage_dtype, device=state_device,
                                                       reset_every=reset_every) if compensate else None)

    def state_dict(self) -> dict:
        """The compensation buffers and step counter (tensors and plain types only)."""
        return {"compensation": self.compensation.state_dict() if self.compensation else {}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore from ``state_dict()``."""
        if self.compensation is not None:
            self.compensation.load_state_dict(sd["compensation"])


def loco_hook(state: LoCoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """LoCo: compensated low-bit gradient all-reduce of one DDP bucket; non-blocking.

    Per parameter: h = g + e; send Q(h); e <- beta*e + (1-beta)*(h - D(Q(h))). The exchange
    runs on the transport's ordered comm thread while backward continues.
    """
    state.last_launch = time.perf_counter()
    state.buckets += 1
    buf = bucket.buffer()
    grads = bucket.gradients()
    names = [state.name_of[id(p)] for p in bucket.parameters()]
    comp = state.compensation
    with torch.no_grad():
        hs = [comp.compensate(n, g.float()) if comp is not None else g.float() for n, g in zip(names, grads)]
        enc = state.aggregator.encode(hs, need_local=comp is not None)
        if comp is not None:
            offset = 0
            for n, h in zip(names, hs):
                comp.update(n, h, enc.local[offset:offset + h.numel()].view_as(h))
                offset += h.numel()
            if bucket.is_last():
                comp.step()  # reset_every counts optimizer steps, not buckets
    transport, aggregator = state.transport, state.aggregator
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def job() -> torch.Tensor:
        return aggregator.exchange(enc, transport)

    def done(f) -> None:
        try:
            buf.copy_(f.result().mean.view_as(buf))
            result.set_result(buf)
        except Exception as e:  # surface the failure in backward, not on the comm thread
            result.set_exception(e)

    transport.submit(job).add_done_callback(done)
    return result
