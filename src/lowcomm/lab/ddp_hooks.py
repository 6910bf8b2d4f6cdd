"""PyTorch's own DDP compression hooks (bf16, PowerSGD), the baselines LoCo is compared with,
under lowcomm's byte meter, registered as ``ddp_hook=bf16`` and ``ddp_hook=powersgd``.

They call ``torch.distributed.all_reduce`` themselves, so that function is wrapped (the one
process-wide monkeypatch the lab makes) to count the calls made on a process group registered
with :func:`meter_all_reduce`, passing every call through unchanged; once the last group is
released with :func:`unmeter_all_reduce` the original function is put back.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.errors import ConfigError
from lowcomm.hooks.ddp import GradReduceState, register_ddp_hook
from lowcomm.transport import Transport, ring_all_reduce_bytes

_METERED_GROUPS: dict = {}
_ORIGINAL_ALL_REDUCE: Any = None


def _metered_all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    transport = _METERED_GROUPS.get(id(group)) if group is not None else None
    if transport is not None:
        n = tensor.numel() * tensor.element_size()
        wire = ring_all_reduce_bytes(n, transport.world_size)  # as the transport counts its own
        transport.meter.record(n, wire, wire, control=False)
    return _ORIGINAL_ALL_REDUCE(tensor, *args, **kwargs)


def meter_all_reduce(transport: Transport) -> None:
    """Count ``dist.all_reduce`` calls on ``transport.group`` in its meter (patches once)."""
    global _ORIGINAL_ALL_REDUCE
    if transport.group is None:
        raise ValueError("metering needs a transport with its own process group")
    if _ORIGINAL_ALL_REDUCE is None:
        _ORIGINAL_ALL_REDUCE = dist.all_reduce
        dist.all_reduce = _metered_all_reduce
    _METERED_GROUPS[id(transport.group)] = transport


def unmeter_all_reduce(transport: Transport) -> None:
    """Stop counting for ``transport``'s group; restore ``dist.all_reduce`` after the last one."""
    global _ORIGINAL_ALL_REDUCE
    _METERED_GROUPS.pop(id(transport.group), None)
    if not _METERED_GROUPS and _ORIGINAL_ALL_REDUCE is not None:
        dist.all_reduce = _ORIGINAL_ALL_REDUCE
        _ORIGINAL_ALL_REDUCE = None


def all_reduce_is_patched() -> bool:
    """Whether ``dist.all_reduce`` is currently lowcomm's metering wrapper."""
    return _ORIGINAL_ALL_REDUCE is not None


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
        if kind == "powersgd":  # PyTorch keeps its memories by bucket index, with a numpy RNG
            self.resume_note = (
                "resuming a PowerSGD run restarts PyTorch's PowerSGD error-feedback and "
                "warm-start memories (they are not part of the checkpoint)"
            )
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


def _maker(kind: str) -> Callable:
    def make(transport: Transport, cfg: Any) -> tuple:
        rank, start = cfg.powersgd_rank, cfg.powersgd_start
        return TorchHookState(transport, kind, rank=rank, start_iter=start), torch_hook

    return make


def register() -> None:
    """Offer PyTorch's hooks to the trainer (``ddp_hook=bf16|powersgd``)."""
    for kind in TORCH_HOOKS:
        register_ddp_hook(kind, _maker(kind))
