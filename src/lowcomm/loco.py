"""Per-step gradient reduction for data-parallel training: DDP communication hooks.

``allreduce_hook`` is the plain FP32 baseline (DDP's own behaviour, but metered by lowcomm's
byte meter and timed, so DDP and the low-communication methods are measured the same way).
``loco_hook`` is LoCo's compensated low-bit reduction (docs/algorithms.md §5), and ``torch_hook``
runs PyTorch's own bf16 and PowerSGD hooks under the same meter, as baselines.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .transport import Transport, ring_all_reduce_bytes


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


# PyTorch's built-in hooks call torch.distributed.all_reduce themselves (PowerSGD's second one
# from a future's callback), so they are metered by wrapping that function once, per process,
# and counting only the calls made on a registered hook's own process group.
_METERED_GROUPS: dict[int, "Transport"] = {}
_UNWRAPPED_ALL_REDUCE = None


def _metered_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    transport = _METERED_GROUPS.get(id(group)) if group is not None else None
    if transport is not None:
        m = transport.world_size
        n = tensor.numel() * tensor.element_size()
        wire = ring_all_reduce_bytes(n, m)  # as the transport counts its own
        transport.meter.record(n, wire, wire, control=False)
    return _UNWRAPPED_ALL_REDUCE(tensor, *args, **kwargs)


def _meter_group(transport: "Transport") -> None:
    global _UNWRAPPED_ALL_REDUCE
    if _UNWRAPPED_ALL_REDUCE is None:
        _UNWRAPPED_ALL_REDUCE = dist.all_reduce
        dist.all_reduce = _metered_all_reduce
    _METERED_GROUPS[id(transport.group)] = transport


TORCH_HOOKS = ("bf16", "powersgd")


class TorchHookState(GradReduceState):
    """PyTorch's own DDP compression hooks (the baselines LoCo is compared with), metered.

    ``kind`` is ``bf16`` (``bf16_compress_hook``: gradients cast to bf16, summed, cast back) or
    ``powersgd`` (``powerSGD_hook`` with error feedback and warm start; rank ``rank``; plain
    all-reduce for the first ``start_iter`` steps, as PyTorch requires before compressing).
    Their bytes are counted at the ``all_reduce`` calls they make on this hook's process group.
    """

    def __init__(self, transport: "Transport", kind: str, rank: int = 1, start_iter: int = 10) -> None:
        super().__init__(transport)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

        if transport.group is None:
            raise ValueError("TorchHookState needs a transport with its own process group "
                             "(its collectives are metered by group)")
        if kind == "bf16":
            self.inner_state: Any = transport.group
            self.inner_hook: Callable = default_hooks.bf16_compress_hook
        elif kind == "powersgd":
            if rank < 1:
                raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
            self.inner_state = psgd.PowerSGDState(
                process_group=transport.group, matrix_approximation_rank=rank,
                start_powerSGD_iter=max(start_iter, 2), use_error_feedback=True, warm_start=True,
                random_seed=0)
            self.inner_hook = psgd.powerSGD_hook
        else:
            raise ValueError(f"unknown PyTorch hook '{kind}': choose one of {', '.join(TORCH_HOOKS)}")
        self.kind = kind
        self.tail: torch.futures.Future | None = None  # the last bucket's future (PowerSGD chaining)
        _meter_group(transport)


def torch_hook(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run PyTorch's hook on one bucket; marks the launch time like the other hooks.

    PowerSGD issues its second and third all-reduce from callbacks, so two buckets in flight
    could interleave their collectives differently on different workers (gloo then aborts on a
    size mismatch). Each PowerSGD bucket therefore starts when the previous one has finished:
    the same collective order everywhere, still off the backward thread. bf16 issues one
    all-reduce per bucket, in bucket order, and needs no chaining.
    """
    state.last_launch = time.perf_counter()
    state.buckets += 1
    prev = state.tail
    if state.kind == "bf16" or prev is None or prev.done():
        fut = state.inner_hook(state.inner_state, bucket)
    else:
        fut = torch.futures.Future()

        def start(_: torch.futures.Future) -> None:
            try:
                inner = state.inner_hook(state.inner_state, bucket)
            except Exception as e:  # surface it in backward
                fut.set_exception(e)
                return

            def forward(f: torch.futures.Future) -> None:
                try:
                    fut.set_result(f.value())
                except Exception as e:
                    fut.set_exception(e)

            inner.add_done_callback(forward)

        prev.add_done_callback(start)
    state.tail = fut
    return fut


class LoCoState(GradReduceState):
    """State of the LoCo hook (docs/algorithms.md §5): codec, compensation buffers, aggregator.

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


def _fsdp_reduce_scatter_base():
    """FSDP2's ReduceScatter interface class, or a clear error where this torch lacks it."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return None, None
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        return None, None
    return FSDPModule, ReduceScatter


_FSDPModule, _ReduceScatterBase = _fsdp_reduce_scatter_base()


class LoCoReduceScatter(_ReduceScatterBase or object):  # type: ignore[misc]
    """LoCo as FSDP2's gradient reduce-scatter (torch >= 2.9, ``set_custom_reduce_scatter``).

    FSDP hands over one flat input, the concatenation of every rank's shard (rank-major), and
    wants this rank's shard back. Per call: h = input + e; each destination's shard is
    quantized (4-bit by default) and sent by all-to-all; the received shards are decoded and
    summed in FP32 and divided by M (so use ``set_gradient_divide_factor(1.0)``; see
    :func:`enable_fsdp_loco`); e <- beta*e + (1-beta)*(h - D(Q(h))). Only the reduce-scatter
    half of LoCo's all-reduce is needed under FSDP. One instance per FSDP module: its
    compensation buffer is keyed by that module's name.
    """

    def __init__(self, key: str, bits: int = 4, beta: float = 0.8, group_size: int = 128,
                 storage_dtype: torch.dtype = torch.float32, compensate: bool = True) -> None:
        from .codecs import make_codec
        from .compensation import MovingAverageCompensation

        self.key = key
        self.codec = make_codec(f"int{bits}", block_size=group_size)
        self.compensation = MovingAverageCompensation(beta, dtype=storage_dtype) if compensate else None
        self._transports: dict[int, Transport] = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer for FSDP's reduce-scatter input/output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def transport(self, group: dist.ProcessGroup) -> Transport:
        """The metered transport for ``group`` (FSDP may pass its own group)."""
        t = self._transports.get(id(group))
        if t is None:
            t = self._transports[id(group)] = Transport(group)
        return t

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any = None, async_op: bool = False) -> None:
        transport = self.transport(group)
        m = transport.world_size
        comp = self.compensation
        with torch.no_grad():
            g = input_tensor.detach().float().reshape(-1)
            h = comp.compensate(self.key, g) if comp is not None else g
            shards = h.view(m, -1)
            payloads = [self.codec.encode(s) for s in shards]
            if comp is not None:
                decoded = torch.cat([self.codec.decode(p, s.shape, f"{self.key} shard {j}")
                                     for j, (p, s) in enumerate(zip(payloads, shards))])
                comp.update(self.key, h, decoded)
            received = transport.all_to_all(payloads)
            shard_shape = shards[0].shape
            total = torch.zeros(shard_shape, dtype=torch.float32, device=g.device)
            for w, p in enumerate(received):
                total += self.codec.decode(p, shard_shape, f"{self.key} shard from worker {w}")
            output_tensor.copy_(total.div_(m).view_as(output_tensor).to(output_tensor.dtype))
        return None


def enable_fsdp_loco(model: torch.nn.Module, **kw: Any) -> dict[str, "LoCoReduceScatter"]:
    """Install :class:`LoCoReduceScatter` on every FSDP2 module of ``model``; returns them by name.

    Sets each module's gradient divide factor to 1.0, since the reduce-scatter returns the mean.
    """
    if _FSDPModule is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no FSDP2 set_custom_reduce_scatter "
                           f"(needs torch >= 2.9): use LoCo through DDP (loco_hook) instead")
    installed: dict[str, LoCoReduceScatter] = {}
    for name, module in model.named_modules():
        if isinstance(module, _FSDPModule):
            rs = installed[name or "root"] = LoCoReduceScatter(name or "root", **kw)
            module.set_custom_reduce_scatter(rs)
            module.set_gradient_divide_factor(1.0)
    if not installed:
        raise ValueError("no FSDP2 module found: call torch.distributed.fsdp.fully_shard first")
    return installed
