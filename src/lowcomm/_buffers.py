"""Module buffers (BatchNorm statistics and the like) as the engine syncs them.

Only persistent buffers count: those in ``state_dict()``. Non-persistent ones (rotary tables,
causal masks) are constants a model rebuilds itself, and averaging them would only cost bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def named_persistent(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) for every buffer that ``model.state_dict()`` holds, in module order."""
    keys = set(model.state_dict(keep_vars=True))
    return [(n, b) for n, b in model.named_buffers() if n in keys]


def persistent(model: nn.Module, floating: bool | None = None) -> list[torch.Tensor]:
    """The persistent buffers; ``floating`` True/False keeps only floating / other dtypes."""
    out = [b for _, b in named_persistent(model)]
    if floating is None:
        return out
    return [b for b in out if b.is_floating_point() == floating]


def float_flat(model: nn.Module) -> torch.Tensor | None:
    """The floating persistent buffers as one flat FP32 tensor on the CPU
    (None if there are none)."""
    bufs = persistent(model, floating=True)
    if not bufs:
        return None
    return torch.cat([b.detach().reshape(-1).to("cpu", torch.float32) for b in bufs])


def load_float_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Write a :func:`float_flat`-shaped tensor back into the floating persistent buffers."""
    offset = 0
    with torch.no_grad():
        for b in persistent(model, floating=True):
            n = b.numel()
            b.copy_(flat[offset : offset + n].view(b.shape))
            offset += n
