"""DDP communication hooks, the per-step baselines: FP32 all-reduce and PyTorch's own hooks.

``allreduce_hook`` is the plain FP32 baseline (DDP's own behaviour, but metered by lowcomm's
byte meter and timed, so DDP and the low-communication methods are measured the same way).
``torch_hook`` runs PyTorch's bf16 and PowerSGD hooks under the same meter (through the one
monkeypatch in :mod:`lowcomm.hooks.patches`). LoCo's hook is in :mod:`lowcomm.hooks.loco_ddp`.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..transport import Transport
from .patches import meter_all_reduce, unmeter_all_reduce


class GradReduceState:
    """State of a DDP comm hook: the metered transport and the time the last bucket was launched.

    The last bucket is launched when backward's own compute ends; whatever backward spends
    after that is waiting on the network, which is how the trainer measures DDP's blocked time.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.last_launch: float = 0.0
        self.buckets: int = 0
        self.work_s: float = 0.0
        """Seconds the hook spent compressing on the backward thread (not computing)."""

    def launched(self) -> None:
        """Mark one bucket handed to the network now."""
        self.last_launch = time.perf_counter()
        self.buckets += 1


def allreduce_hook(
    state: GradReduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """FP32 mean all-reduce of one DDP bucket, counted by the transport's byte meter."""
    state.launched()
    buf = bucket.buffer()
    buf.div_(state.transport.world_size)
    return state.transport.all_reduce_async(buf)


TORCH_HOOKS = ("bf16", "powersgd")


class TorchHookState(GradReduceState):
    """PyTorch's own DDP compression hooks (the baselines LoCo is compared with), metered.

    ``kind`` is ``bf16`` (``bf16_compress_hook``: gradients cast to bf16, summed, cast back) or
    ``powersgd`` (``powerSGD_hook`` with error feedback and warm start; rank ``rank``; plain
    all-reduce for the first ``start_iter`` steps, as PyTorch requires before compressing).
    Their bytes are counted at the ``all_reduce`` calls they make on this hook's process group;
    ``close()`` stops counting (and undoes the patch once no hook needs it).
    """

    def __init__(
        self, transport: Transport, kind: str, rank: int = 1, start_iter: int = 10
    ) -> None:
        super().__init__(transport)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        if transport.group is None:
            raise ValueError(
                "TorchHookState needs a transport with its own process group "
                "(its collectives are metered by group)"
            )
        if kind == "bf16":
            self.inner_state: Any = transport.group
            self.inner_hook: Callable = default_hooks.bf16_compress_hook
        elif kind == "powersgd":
            if rank < 1:
                raise ConfigError(f"PowerSGD rank must be >= 1, got {rank}: set powersgd_rank >= 1")
            self.inner_state = psgd.PowerSGDState(
                process_group=transport.group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=max(start_iter, 2),
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
            )
            self.inner_hook = psgd.powerSGD_hook
        else:
            raise ConfigError(
                f"unknown PyTorch hook '{kind}': choose one of {', '.join(TORCH_HOOKS)}"
            )
        self.kind = kind
        # the last bucket's future (PowerSGD chaining)
        self.tail: torch.futures.Future | None = None
        meter_all_reduce(transport)

    def close(self) -> None:
        """Stop metering this hook's group (restores ``dist.all_reduce`` after the last one)."""
        unmeter_all_reduce(self.transport)


def _after(
    prev: torch.futures.Future, start: Callable[[], torch.futures.Future]
) -> torch.futures.Future:
    """A future for ``start()``'s result, with ``start`` run once ``prev`` is done."""
    fut: torch.futures.Future = torch.futures.Future()

    def forward(f: torch.futures.Future) -> None:
        try:
            fut.set_result(f.value())
        except Exception as e:  # surface it in backward
            fut.set_exception(e)

    def run(_: torch.futures.Future) -> None:
        try:
            start().add_done_callback(forward)
        except Exception as e:
            fut.set_exception(e)

    prev.add_done_callback(run)
    return fut


def torch_hook(
    state: TorchHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Run PyTorch's hook on one bucket; marks the launch time like the other hooks.

    PowerSGD issues its second and third all-reduce from callbacks, so two buckets in flight
    could interleave their collectives differently on different workers (gloo then aborts on a
    size mismatch). Each PowerSGD bucket therefore starts when the previous one has finished:
    the same collective order everywhere, still off the backward thread. bf16 issues one
    all-reduce per bucket, in bucket order, and needs no chaining.
    """
    state.launched()
    prev = state.tail
    if state.kind == "bf16" or prev is None or prev.done():
        fut = state.inner_hook(state.inner_state, bucket)
    else:
        fut = _after(prev, lambda: state.inner_hook(state.inner_state, bucket))
    state.tail = fut
    return fut
