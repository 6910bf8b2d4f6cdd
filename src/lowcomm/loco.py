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
