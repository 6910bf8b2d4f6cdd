"""Tensor plumbing of the engine: a rank's part of a parameter, flat buffers and their views.

No math of any method lives here, only how parameters map onto the flat FP32 buffers the
engine keeps (one per fragment) and back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

from .. import _buffers
from ..codecs import _native
from ..codecs.topk_many import wanted
from ..outer import chunk

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
    without allocating (on a CPU a fresh model-sized tensor costs its page faults: writing into
    one took 2.3x as long as into a kept buffer, benchmarks/sync_cost.md). Each bucket's run of
    parameters is followed by one spare element, where the all-reduce's validity flag goes, so
    a bucket's slab can be the payload itself."""

    def __init__(self, params: list[torch.Tensor], groups: list[list[int]], device: torch.device):
        sizes = [sum(params[i].numel() for i in g) for g in groups]
        self.flat = torch.empty(sum(sizes) + len(groups), dtype=torch.float32, device=device)
        self.slabs, self.views = [], []
        at = 0
        for g, n in zip(groups, sizes):
            slab = self.flat[at : at + n + 1]
            self.slabs.append(slab)
            self.views += views(slab[:n], [params[i] for i in g])
            at += n + 1
        self._own: torch.Tensor | None = None

    def own(self) -> torch.Tensor:
        """A flat buffer for what this send contributes, decoded (the continue merge's), kept
        until its result is merged: it lives as long as these slabs' send."""
        if self._own is None:
            self._own = torch.empty(self.flat.numel() - len(self.slabs), device=self.flat.device)
        return self._own


def elsewhere(params: list[torch.Tensor], device: torch.device) -> bool:
    """Whether ``params`` live on an accelerator while the state is on ``device`` (the host:
    ``state_device=cpu``): every transfer between them is then made whole, see
    :func:`values_on` and :func:`on_device_of`."""
    return bool(params) and device.type == "cpu" and params[0].device.type != "cpu"


def values_on(device: torch.device, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The params' values in FP32 on ``device``, shaped like them. From an accelerator to the
    host, one transfer of their concatenation into pinned memory (the host waits once, where
    a copy per parameter would wait per parameter)."""
    if not elsewhere(params, device):
        return [p.detach().to(device, torch.float32) for p in params]
    flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
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


def minus_params_into(
    out: list[torch.Tensor], reference: torch.Tensor, params: list[torch.Tensor]
) -> None:
    """``reference`` (flat) minus the params, written into ``out`` (views shaped like them).

    On an accelerator as multi-tensor kernels (a copy, then the subtraction: the same bits),
    whose launches do not grow with the number of parameters."""
    refs = views(reference, params)
    plain = values_on(reference.device, params)
    if wanted(reference.device):
        torch._foreach_copy_(out, refs)
        torch._foreach_sub_(out, plain)
        return
    for o, r, p in zip(out, refs, plain):
        torch.sub(r, p, out=o)


def copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target: on an accelerator, with matching dtypes, as
    multi-tensor kernels (launches that do not grow with the number of tensors)."""
    same = all(t.dtype == s.dtype and t.device == s.device for t, s in zip(targets, sources))
    if targets and same and wanted(targets[0].device):
        torch._foreach_copy_(targets, sources)
        return
    for t, s in zip(targets, sources):
        t.copy_(s)


def pieces(params: list[torch.Tensor], *flats: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """(a piece of a parameter, the same piece of each flat buffer), chunk by chunk, over the
    parameters in order: the flats are laid out like :func:`views` of them. A sequence of
    element-wise ops on a piece then re-reads it from the core's cache (CPU; an accelerator
    takes a parameter whole). A parameter that is not contiguous comes whole, in its shape."""
    offset = 0
    for p in params:
        n = p.numel()
        parts = [f[offset : offset + n] for f in flats]
        if not p.is_contiguous():
            yield (p, *(f.view(p.shape) for f in parts))
        else:
            pf, step = p.view(-1), chunk(p)
            for at in range(0, n, step):
                yield (pf[at : at + step], *(f[at : at + step] for f in parts))
        offset += n


def fused_minus(
    out: list[torch.Tensor],
    reference: torch.Tensor,
    params: list[torch.Tensor],
    snapshot: torch.Tensor | None = None,
) -> bool | None:
    """:func:`minus_params_into` (and, with ``snapshot``, the params copied into it) by the
    fused kernel, which also says whether every difference is finite: one pass, where the
    separate check cost another. None (nothing done) unless everything is FP32 on a CPU."""
    plain = [p.detach() for p in params]
    if any(p.dtype != torch.float32 for p in plain):
        return None
    kernels = _native.usable(reference, *out, *plain)
    if kernels is None:
        return None
    refs = views(reference, params)
    snaps = views(snapshot, params) if snapshot is not None else [None] * len(params)
    bad = False
    for o, r, p, s in zip(out, refs, plain, snaps):
        bad |= bool(
            kernels.lc_sub_check(
                _native.ptr(r),
                _native.ptr(p),
                _native.ptr(o),
                None if s is None else _native.ptr(s),
                p.numel(),
            )
        )
    return not bad


def all_finite(*ts: torch.Tensor) -> bool:
    """Whether every element of every tensor is finite (:func:`finite_flag`, read once)."""
    return bool(finite_flag(*ts))


def finite_flag(*ts: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on the tensors' device: whether every element of every tensor is finite,
    exactly when their minima and maxima are (NaN propagates). Nothing is read to the host.

    One read pass; ``isfinite(t).all()`` writes a model-sized mask first (5x a copy on a CPU).
    """
    ends = [v for t in ts if t.numel() for v in torch.aminmax(t)]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=ts[0].device if ts else None)
    return torch.isfinite(torch.stack(ends)).all()


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
