"""DDP communication hooks, the per-step baseline: FP32 all-reduce, metered.

``allreduce_hook`` is the plain FP32 baseline (DDP's own behaviour, but metered by lowcomm's
byte meter and timed, so DDP and the low-communication methods are measured the same way).
Other hooks a run may name are registered in :data:`DDP_HOOKS` (the lab's PyTorch bf16 and
PowerSGD, metered); LoCo's hook is in :mod:`lowcomm.hooks.loco_ddp`.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import plugins
from ..errors import ConfigError
from ..transport import Transport


class GradReduceState:
    """State of a DDP comm hook: the metered transport and the time the last bucket was launched.

    The last bucket is launched when backward's own compute ends; whatever backward spends
    after that is waiting on the network, which is how the trainer measures DDP's blocked time.
    ``resume_note``: what a resumed run of this hook does not restore, said at the resume.
    """

    resume_note = ""

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


HookMaker = Callable[[Transport, Any], "tuple[GradReduceState, Callable[..., Any]]"]
"""Makes a per-step comm hook and its state from the run's transport and trainer config."""

DDP_HOOKS: dict[str, HookMaker] = {
    "allreduce": lambda transport, cfg: (GradReduceState(transport), allreduce_hook),
}
"""The comm hooks a run may name with ``ddp_hook=``: FP32 all-reduce here; PyTorch's own
compressing hooks, metered, come with lowcomm's lab (:mod:`lowcomm.plugins`)."""


def register_ddp_hook(name: str, make: HookMaker) -> None:
    """Offer a per-step comm hook under ``name`` (``ddp_hook=NAME``)."""
    if DDP_HOOKS.get(name, make) is not make:
        raise ValueError(f"DDP hook {name!r} is taken")
    DDP_HOOKS[name] = make


def make_ddp_hook(name: str, transport: Transport, cfg: Any) -> tuple[GradReduceState, Any]:
    """The state and hook registered as ``name`` (the plugins looked at if need be)."""
    if name not in DDP_HOOKS:
        plugins.load()
    if name not in DDP_HOOKS:
        raise ConfigError(
            f"ddp_hook={name} is not installed here (PyTorch's bf16 and PowerSGD hooks come "
            f"with lowcomm's lab): use ddp_hook=allreduce, or install lowcomm whole"
        )
    return DDP_HOOKS[name](transport, cfg)
