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


class Slabs:
    """A persistent flat FP32 buffer for one fragment's pseudo-gradient, so a sync writes it
    without allocating (on a CPU a fresh model-sized tensor pays a first touch of every page,
    benchmarks/sync_cost.md). The parameters' values one after another, then one spare
    element, where the all-reduce's validity flag goes, so the slab can be the payload itself
    (``flat``; ``values`` without the spare, ``views`` shaped like the parameters)."""

    def __init__(self, params: list[torch.Tensor], device: torch.device) -> None:
        n = sum(p.numel() for p in params)
        self.flat = torch.empty(n + 1, dtype=torch.float32, device=device)
        self.values = self.flat[:n]
        self.views = views(self.values, params)
        self._own: torch.Tensor | None = None

    def own(self) -> torch.Tensor:
        """A flat buffer for what this send contributes, decoded (the continue merge's), kept
        until its result is merged: it lives as long as these slabs' send."""
        if self._own is None:
            self._own = torch.empty(self.values.numel(), device=self.flat.device)
        return self._own


def elsewhere(params: list[torch.Tensor], device: torch.device) -> bool:
    """Whether ``params`` live on an accelerator while the state is on ``device`` (the host:
    ``state_device=cpu``): every transfer between them is then made whole, see
    :func:`values_on` and :func:`on_device_of`."""
    return bool(params) and device.type == "cpu" and params[0].device.type != "cpu"


def values_on(device: torch.device, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The params' values on ``device``, shaped like them: the params themselves where they live
    there (in their own dtype: the multi-tensor kernels that read them cast), else from an
    accelerator to the host one transfer of their FP32 concatenation into pinned memory (the
    host waits once, where a copy per parameter would wait per parameter)."""
    if not elsewhere(params, device):
        return [p.detach() for p in params]
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(torch.float32)
    host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=flat.is_cuda)
    return views(host.copy_(flat), params)


_COPY: dict[int, torch.cuda.Stream] = {}  # a GPU's copy stream, for the process's life


def on_device_of(params: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (a state buffer) where ``params`` live: itself, or from the host's pinned
    memory to the GPU in one transfer on a copy stream of its own, overlapping the kernels
    queued before it; the host waits for the transfer (it may write ``flat`` next: an outer
    step, a restore)."""
    if not elsewhere(params, flat.device):
        return flat
    device = params[0].device
    if device.type != "cuda" or not flat.is_pinned():
        return flat.to(device)
    if device.index not in _COPY:
        _COPY[device.index] = torch.cuda.Stream(device)
    # a blocking copy on the copy stream: the host waits for it alone, not for the training
    # kernels queued on the compute stream, and it is done before anything there reads it
    with torch.cuda.stream(_COPY[device.index]):
        out = flat.to(device)
    out.record_stream(torch.cuda.current_stream(device))  # its memory is used there
    return out


def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target (casting where their dtypes differ) as multi-tensor
    kernels: launches that do not grow with the number of tensors."""
    if targets:
        torch._foreach_copy_(targets, sources)


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
