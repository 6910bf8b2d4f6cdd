"""Every process-wide monkeypatch lowcomm makes, in one place, and how to undo it.

There is one: ``torch.distributed.all_reduce`` is wrapped so that PyTorch's own DDP compression
hooks (bf16, PowerSGD), which call that function themselves, are counted by lowcomm's byte
meter like every other method. The wrapper counts only calls made on a process group that was
registered with :func:`meter_all_reduce` and passes every call through unchanged; once the last
group is released with :func:`unmeter_all_reduce` the original function is put back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..transport import ring_all_reduce_bytes

if TYPE_CHECKING:
    from ..transport import Transport

_METERED_GROUPS: dict[int, Transport] = {}
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
