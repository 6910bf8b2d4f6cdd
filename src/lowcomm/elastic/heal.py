"""Healing a joining site from a live peer: the run's shared state, on the quorum's own group.

The state is the engine's shared parts (declared once, ``StatePart(shared=True)``), written
with ``torch.save`` and read with ``torch.load(weights_only=True)``: tensors and plain types,
never a peer's pickle. Every member then compares a SHA-256 of its shared state, the joiner's
taken from what it loaded into its own engine, so a heal that is not bit-exact is never
trained on.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch

from ..transport import Transport
from .faults import die_if_armed


def pack(state: dict[str, Any]) -> torch.Tensor:
    """``state`` as the bytes of a ``torch.save``, in a uint8 tensor."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(payload: torch.Tensor) -> dict[str, Any]:
    """What :func:`pack` wrote; tensors and plain types only (``weights_only=True``)."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def digest(state: Any) -> bytes:
    """A SHA-256 of ``state``'s contents: keys, tensor dtypes, shapes and bytes, plain values
    (the same for equal state, however it was built)."""
    h = hashlib.sha256()
    _feed(h, state)
    return h.digest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(f"D{len(value)}".encode())
        for k in sorted(value, key=str):
            h.update(f"K{k!r}".encode())
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(f"V{value!r}".encode())


def hand_over(transport: Transport, src: int, state: dict[str, Any] | None) -> tuple[Any, int]:
    """Rank ``src`` sends ``state`` to every member of the group (the others pass None); each
    gets it back, unpacked, with its size in bytes."""
    payload = pack(state) if transport.rank == src else torch.empty(0, dtype=torch.uint8)
    size = transport.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src)
    if transport.rank == src:
        die_if_armed("healer")  # a healer:SITE fault: dies here, mid-hand-over
    if transport.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    transport.broadcast(payload, src)
    return (state if transport.rank == src else unpack(payload)), payload.numel()


def agree(transport: Transport, state: dict[str, Any]) -> bool:
    """Whether every member's digest of its shared state is the same (all learn the answer)."""
    mine = torch.frombuffer(bytearray(digest(state)), dtype=torch.uint8)
    return all(torch.equal(mine, d) for d in transport.all_gather(mine, control=True))


def mismatch(where: str) -> str:
    """The one line said when a heal was not bit-exact."""
    return (
        f"the shared state differs between sites after the heal at {where}: the joiner is left out"
    )
