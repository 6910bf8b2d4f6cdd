"""LoCo as FSDP2's gradient reduce-scatter (torch >= 2.9, ``set_custom_reduce_scatter``).

FSDP hands over one flat input, the concatenation of every rank's shard (rank-major), and
wants this rank's shard back. That is the first half of the two-phase reduce, so it runs
through :meth:`~lowcomm.aggregate.Aggregator.reduce_scatter` with the compensation interface:
``h = input + e``; each destination's shard is quantised and sent by all-to-all; the received
shards are decoded and summed in FP32 and divided by M (so the gradient divide factor is set to
1.0); ``e <- beta e + (1 - beta)(h - D(Q(h)))``. Only one quantisation, so one buffer per FSDP
module, kept on the gradient's device and reset every ``reset_every`` calls, i.e. optimizer
steps (one reduce-scatter per module per step). The flat input mixes a module's matrices and
vectors, so everything in it is quantised, in flat groups of ``group_size`` (either quantiser).
With fp16 and a ``GradScaler`` passed as ``scaler=``, the buffer follows the loss scale (dropped
when it backs off after an overflow, rescaled when it grows); a non-finite input on any worker
returns NaN everywhere, so the scaler skips that step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..aggregate import Aggregator
from ..compensation import DEFAULT_RESET_EVERY, MovingAverageCompensation
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
    """LoCo's compressed reduce-scatter for one FSDP2 module (its buffer keyed by ``key``)."""

    def __init__(self, key: str, bits: int = 4, beta: float = 0.8, group_size: int = 128,
                 storage_dtype: torch.dtype = torch.float32, compensate: bool = True,
                 reset_every: int = DEFAULT_RESET_EVERY,
                 quantizer: str = DEFAULT_QUANTIZER, scaler: Any = None) -> None:
        check_quantizer(quantizer, bits)
        self.key = key
        self.codec = loco_codec(quantizer, bits, group_size)
        # device=None: the buffer stays where FSDP's gradients are
        self.compensation = (MovingAverageCompensation(beta, dtype=storage_dtype, device=None,
                                                       reset_every=reset_every)
                             if compensate else None)
        self.loss_scale = LossScale(self.compensation)
        self.scaler = scaler
        self._transports: dict[int, Transport] = {}

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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
        m, comp = transport.world_size, self.compensation
        agg = Aggregator("two-phase", self.codec, m)
        if self.scaler is not None:  # once per step: this module reduces once per backward
            self.loss_scale.follow(self.scaler)
        with torch.no_grad():
            g = input_tensor.detach().float().reshape(-1)
            valid = bool(torch.isfinite(g).all())
            h = comp.before_send(self.key, g) if comp is not None and valid else g
            enc = agg.encode_shards(h.view(m, -1), need_local=comp is not None, valid=valid)
            if comp is not None and valid:
                comp.after_send(self.key, h, enc.local)
            red = agg.reduce_scatter(enc, transport)
            mean = red.mean if red.valid_workers == m else torch.full_like(red.mean, float("nan"))
            output_tensor.copy_(mean.view_as(output_tensor))
            if red.valid_workers < m:
                self.loss_scale.reset()  # an fp16 overflow somewhere: drop the scaled errors
            elif comp is not None:
                comp.step()
        return None


def enable_fsdp_loco(model: torch.nn.Module, **kw: Any) -> dict[str, LoCoReduceScatter]:
    """Install :class:`LoCoReduceScatter` on every FSDP2 module of ``model``; returns them by name.

    Sets each module's gradient divide factor to 1.0, since the reduce-scatter returns the mean.
    ``kw`` are :class:`LoCoReduceScatter`'s settings.
    """
    if _FSDPModule is None:
        raise ConfigError(f"this torch ({torch.__version__}) has no FSDP2 "
                          f"set_custom_reduce_scatter (needs torch >= 2.9): use LoCo through "
                          f"DDP (loco_hook) instead")
    installed: dict[str, LoCoReduceScatter] = {}
    for name, module in model.named_modules():
        if isinstance(module, _FSDPModule):
            rs = installed[name or "root"] = LoCoReduceScatter(name or "root", **kw)
            module.set_custom_reduce_scatter(rs)
            module.set_gradient_divide_factor(1.0)
    if not installed:
        raise ConfigError("no FSDP2 module found: call torch.distributed.fsdp.fully_shard first")
    return installed
