"""Tensor plumbing of the engine: a rank's part of a parameter, flat buffers and their views.

No math of any method lives here, only how parameters map onto the flat FP32 buffers the
engine keeps (one per fragment) and back.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _buffers

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support: no sharded parameters
    DTensor = ()  # type: ignore[assignment,misc]

Part = tuple[int, int]  # DDP inside a worker: (this rank's slice, slices)


def local(t: torch.Tensor, part: Part | None = None) -> torch.Tensor:
    """This rank's part of ``t`` (same storage): a DTensor's local shard; with DDP inside a
    worker (``part`` = (i, n)) the i-th of n slices of its rows; else ``t`` itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # a plain view of the shard, outside autograd
            return t.to_local()
    if part is None:
        return t
    flat = t.detach()
    flat = flat.reshape(1) if flat.dim() == 0 else flat
    return flat.tensor_split(part[1], dim=0)[part[0]]


def views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, in order."""
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def buckets(params: list[torch.Tensor], bucket_numel: int) -> list[list[int]]:
    """Consecutive parameter indices grouped so each group stays under ``bucket_numel``."""
    out: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if out[-1] and size + p.numel() > bucket_numel:
            out.append([])
            size = 0
        out[-1].append(i)
        size += p.numel()
    return out


def minus_params(reference: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``reference`` minus the params (flat, FP32, on its device) in one pass, without first
    copying the params into a flat buffer."""
    out = torch.empty_like(reference)
    for o, r, p in zip(views(out, params), views(reference, params), params):
        torch.sub(r, p.detach().to(reference.device, torch.float32), out=o)
    return out


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: exactly when its min and max are (NaN propagates).

    One read pass; ``isfinite(t).all()`` writes a model-sized mask first (5x a copy on a CPU).
    """
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def named_state(model: nn.Module, part: Part | None) -> dict[str, torch.Tensor]:
    """Clones of (this rank's part of) the trainable parameters and persistent buffers."""
    out = {
        n: local(p, part).detach().clone() for n, p in model.named_parameters() if p.requires_grad
    }
    out.update({n: b.detach().clone() for n, b in _buffers.named_persistent(model)})
    return out


def load_named(model: nn.Module, values: dict[str, torch.Tensor], part: Part | None) -> None:
    """Copy ``values`` (as :func:`named_state` returns them) into the model."""
    targets = {n: local(p, part) for n, p in model.named_parameters()}
    targets.update(dict(_buffers.named_persistent(model)))
    with torch.no_grad():
        for name, value in values.items():
            targets[name].copy_(value)
