"""LoCo as FSDP2's gradient reduce-scatter (torch >= 2.9, ``set_custom_reduce_scatter``).

FSDP hands over one flat input, the concatenation of every rank's shard (rank-major), and
wants this rank's shard back. That is the first half of the two-phase reduce, so it runs
through :meth:`~lowcomm.aggregate.TwoPhaseAggregator.reduce_scatter` with the compensation
interface: ``h = input + e``; each destination's shard is quantised and sent by all-to-all; the
received shards are decoded and summed in FP32 and divided by M (so the gradient divide factor
is set to 1.0); ``e <- beta e + (1 - beta)(h - D(Q(h)))``. Only one quantisation, so one buffer
per FSDP module, kept on the gradient's device and reset every ``reset_every`` calls, i.e.
optimizer steps (one reduce-scatter per module per step). The flat input mixes a module's
matrices and vectors: the elements of 1-D parameters (found from FSDP2's layout) are
reduce-scattered as FP32, the rest quantised in flat groups of ``group_size`` (either quantiser).
With fp16 and a ``GradScaler`` passed as ``scaler=``, the buffer follows the loss scale (dropped
when it backs off after an overflow, rescaled when it grows); a non-finite input on any worker
returns NaN everywhere, so the scaler skips that step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..aggregate import Reduced, TwoPhaseAggregator
from ..codecs import make_codec
from ..compensation import DEFAULT_RESET_EVERY, Compensation, MovingAverageCompensation
from ..errors import ConfigError
from ..transport import Transport
from .loco_common import DEFAULT_QUANTIZER, LossScale, check_quantizer, loco_codec


def _fsdp_reduce_scatter_base() -> tuple[Any, Any]:
    """FSDP2's module class and ReduceScatter interface, or (None, None) where torch lacks it."""
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
    """LoCo's compressed reduce-scatter for one FSDP2 module (its buffer keyed by ``key``).

    ``shapes``: the global shapes of the parameters this module's FSDP group reduces, in its
    order (:func:`enable_fsdp_loco` finds them), so that its 1-D ones go as FP32 unless
    ``compress_1d``. Where they do not add up to FSDP's input (a parameter without a gradient
    this step, an FSDP layout this code does not know), everything is quantised.
    """

    def __init__(
        self,
        key: str,
        bits: int = 4,
        beta: float = 0.8,
        group_size: int = 128,
        storage_dtype: torch.dtype = torch.float32,
        compensate: bool = True,
        reset_every: int = DEFAULT_RESET_EVERY,
        quantizer: str = DEFAULT_QUANTIZER,
        scaler: Any = None,
        shapes: list[torch.Size] | None = None,
        compress_1d: bool = False,
    ) -> None:
        check_quantizer(quantizer, bits)
        self.key = key
        self.codec = loco_codec(quantizer, bits, group_size)
        # device=None: the buffer stays where FSDP's gradients are
        self.compensation = (
            MovingAverageCompensation(
                beta, dtype=storage_dtype, device=None, reset_every=reset_every
            )
            if compensate
            else None
        )
        self.loss_scale = LossScale(self.compensation)
        self.scaler = scaler
        self.shapes = None if compress_1d or shapes is None else [torch.Size(s) for s in shapes]
        self._transports: dict[int, Transport] = {}
        self._masks: dict[tuple[int, int, str], torch.Tensor | None] = {}

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer for FSDP's reduce-scatter input/output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def transport(self, group: dist.ProcessGroup) -> Transport:
        """The metered transport for ``group`` (FSDP may pass its own group)."""
        t = self._transports.get(id(group))
        if t is None:
            t = self._transports[id(group)] = Transport(group)
        return t

    def dense_mask(self, chunk: int, m: int, device: torch.device) -> torch.Tensor | None:
        """Which elements of one rank's chunk belong to 1-D parameters (None: quantise all).

        FSDP2 pads each parameter's dim 0 to a multiple of M and puts its r-th slice, of
        ceil(dim0 / M) rows, in rank r's chunk, parameter after parameter.
        """
        cache = (chunk, m, str(device))
        if cache not in self._masks:
            mask = None
            if self.shapes and all(len(s) >= 1 for s in self.shapes):
                sizes = [-(-s[0] // m) * (s.numel() // max(s[0], 1)) for s in self.shapes]
                if sum(sizes) == chunk and any(len(s) == 1 for s in self.shapes):
                    mask = torch.zeros(chunk, dtype=torch.bool, device=device)
                    at = 0
                    for s, n in zip(self.shapes, sizes):
                        mask[at : at + n] = len(s) == 1
                        at += n
            self._masks[cache] = mask
        return self._masks[cache]

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = None,
        async_op: bool = False,
    ) -> None:
        transport = self.transport(group)
        m = transport.world_size
        if self.scaler is not None:  # once per step: this module reduces once per backward
            self.loss_scale.follow(self.scaler)
        with torch.no_grad():
            x = input_tensor.detach().float().view(m, -1)
            valid = bool(torch.isfinite(x).all())  # a host sync, on purpose: as in loco_ddp
            mask = self.dense_mask(x.shape[1], m, x.device)
            if mask is None:
                red = self._quantised(x, valid, transport)
                mean = red.mean
            else:
                red = self._quantised(x[:, ~mask], valid, transport)
                dense = _reduce(
                    TwoPhaseAggregator(make_codec("fp32"), m),
                    x[:, mask],
                    None,
                    None,
                    valid,
                    transport,
                )
                mean = torch.empty(x.shape[1], dtype=torch.float32, device=red.mean.device)
                mean[~mask], mean[mask] = red.mean, dense.mean
            if red.valid_workers < m:  # an fp16 overflow somewhere: NaN everywhere, drop errors
                mean = torch.full_like(mean, float("nan"))
                self.loss_scale.reset()
            elif self.compensation is not None:
                self.compensation.step()
            output_tensor.copy_(mean.view_as(output_tensor))
        return None

    def _quantised(self, x: torch.Tensor, valid: bool, transport: Transport) -> Reduced:
        agg = TwoPhaseAggregator(self.codec, transport.world_size)
        return _reduce(agg, x, self.compensation, self.key, valid, transport)


def _reduce(
    agg: TwoPhaseAggregator,
    x: torch.Tensor,
    comp: Compensation | None,
    key: str | None,
    valid: bool,
    transport: Transport,
) -> Reduced:
    """Compensate (when ``comp``) and reduce-scatter ``x`` (M x n, row j for worker j)."""
    comp = comp if valid else None
    h = comp.before_send(key, x.reshape(-1)) if comp is not None else x
    enc = agg.encode_shards(h.reshape(x.shape), need_local=comp is not None, valid=valid)
    if comp is not None:
        comp.after_send(key, h, enc.local)
    return agg.reduce_scatter(enc, transport)


def _managed_shapes(module: torch.nn.Module) -> list[torch.Size]:
    """Global shapes of the parameters ``module``'s own FSDP group holds (not its children's)."""
    inner: set[int] = set()
    for sub in module.modules():
        if sub is not module and isinstance(sub, _FSDPModule):
            inner.update(id(p) for p in sub.parameters())
    return [p.shape for p in module.parameters() if id(p) not in inner]


def enable_fsdp_loco(model: torch.nn.Module, **kw: Any) -> dict[str, LoCoReduceScatter]:
    """Install :class:`LoCoReduceScatter` on every FSDP2 module of ``model``; returns them by name.

    Sets each module's gradient divide factor to 1.0, since the reduce-scatter returns the mean.
    ``kw`` are :class:`LoCoReduceScatter`'s settings.
    """
    if _FSDPModule is None:
        raise ConfigError(
            f"this torch ({torch.__version__}) has no FSDP2 "
            f"set_custom_reduce_scatter (needs torch >= 2.9): use LoCo through "
            f"DDP (loco_hook) instead"
        )
    installed: dict[str, LoCoReduceScatter] = {}
    for name, module in model.named_modules():
        if isinstance(module, _FSDPModule):
            rs = LoCoReduceScatter(name or "root", **{**kw, "shapes": _managed_shapes(module)})
            installed[name or "root"] = rs
            module.set_custom_reduce_scatter(rs)
            module.set_gradient_divide_factor(1.0)
    if not installed:
        raise ConfigError("no FSDP2 module found: call torch.distributed.fsdp.fully_shard first")
    return installed
