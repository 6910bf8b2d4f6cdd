"""Healing a joining site from the live members: the run's shared state, on the quorum's own
group, sent to the joiners only and striped across the members that hold it.

The state is the engine's shared parts (declared once, ``StatePart(shared=True)``), written
with ``torch.save`` and read with ``torch.load(weights_only=True)``: tensors and plain types,
never a peer's pickle. The joiner checks the bytes it assembled against their SHA-256, and then
every member compares a SHA-256 of its shared state, the joiner's taken from what it loaded
into its own engine, so a heal that is not bit-exact is never trained on. A member that dies
during the hand-over fails the attempt: the others retry without it and the joiner asks again.
"""

from __future__ import annotations

import hashlib
import hmac
import io
from collections.abc import Callable
from typing import Any

import torch

from ..errors import MembershipError
from ..transport import Transport


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


def hand_over(
    transport: Transport,
    joiners: list[int],
    healer: int,
    state: dict[str, Any] | None,
    record: dict[str, Any] | None = None,
    seal: Callable[[bytes], bytes] | None = None,
) -> tuple[Any, Any, int, int]:
    """The run's shared ``state`` to the ``joiners`` (group ranks) only, striped across every
    old member: old member i of k sends the joiners the i-th k-th of its bytes, so each sends
    1/k of them and the joiners' link carries them once; the ``healer``'s ``record`` (the
    membership history, which each member timed itself) comes whole from it. Old members pass
    their state, joiners None. Each old member's size and digest go to all first; where they
    differ, the whole state comes from the healer. A joiner checks the assembled bytes against
    the digest before it loads them, and with ``seal`` (the MAC of some bytes under the run's
    key: see :mod:`.admission`) the healer's MAC of both digests. Returns (state, record: for
    a joiner unpacked), the state's size in bytes and how many members sent it."""
    old = [r for r in range(transport.world_size) if r not in joiners]
    mine = pack(state) if state is not None else _EMPTY
    rec = pack(record) if transport.rank == healer and record is not None else _EMPTY
    seal = seal or (lambda message: b"")
    meta = _meta(mine, rec, state is not None)
    if transport.rank == healer:
        meta[_MAC] = _bytes(seal(bytes(meta[8:40].tolist()) + _sha(rec)).ljust(32, b"\0"))
    metas = transport.all_gather(meta, control=True)
    sources = old if all(torch.equal(metas[r][:40], metas[old[0]][:40]) for r in old) else [healer]
    size, rec_size = (int(x) for x in metas[healer][_SIZES].view(torch.int64).tolist())
    cuts = [size * i // len(sources) for i in range(len(sources) + 1)]
    if transport.rank in joiners:
        payload, got = (
            torch.empty(size, dtype=torch.uint8),
            torch.empty(rec_size, dtype=torch.uint8),
        )
        recvs = {r: payload[cuts[i] : cuts[i + 1]] for i, r in enumerate(sources)}
        transport.exchange_p2p({}, {r: t for r, t in recvs.items() if t.numel()})
        transport.exchange_p2p({}, {healer: got})
        digest_ = bytes(metas[healer][8:40].tolist())
        if _sha(payload) != digest_:
            raise RuntimeError("the healed state's bytes differ from their digest: asking again")
        if not hmac.compare_digest(
            bytes(metas[healer][_MAC].tolist()), seal(digest_ + _sha(got)).ljust(32, b"\0")
        ):
            raise MembershipError(
                "the healed state carries no valid MAC under this site's run secret: refused"
            )
        return unpack(payload), unpack(got), size, len(sources)
    if transport.rank in sources:
        i = sources.index(transport.rank)
        stripe = mine[cuts[i] : cuts[i + 1]]
        transport.exchange_p2p({j: stripe for j in joiners} if stripe.numel() else {}, {})
    if transport.rank == healer:
        transport.exchange_p2p({j: rec for j in joiners}, {})
    return state, record, size, len(sources)


_EMPTY = torch.empty(0, dtype=torch.uint8)
_SIZES = slice(40, 56)  # in a member's meta: the state's and the record's sizes (int64 each)
_MAC = slice(56, 88)  # ... and the healer's MAC of the state's and the record's SHA-256


def _sha(data: torch.Tensor) -> bytes:
    return hashlib.sha256(data.numpy()).digest()


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _meta(state: torch.Tensor, record: torch.Tensor, holds: bool) -> torch.Tensor:
    """A member's 88 bytes before a hand-over: its state's size and SHA-256, then the sizes of
    its state and record (zeros for a joiner), then room for the healer's MAC."""
    meta = torch.zeros(88, dtype=torch.uint8)
    if holds:
        meta[:8] = torch.tensor([state.numel()], dtype=torch.int64).view(torch.uint8)
        meta[8:40] = _bytes(_sha(state))
    meta[_SIZES] = torch.tensor([state.numel(), record.numel()], dtype=torch.int64).view(
        torch.uint8
    )
    return meta


def agree(transport: Transport, state: dict[str, Any]) -> bool:
    """Whether every member's digest of its shared state is the same (all learn the answer)."""
    mine = torch.frombuffer(bytearray(digest(state)), dtype=torch.uint8)
    return all(torch.equal(mine, d) for d in transport.all_gather(mine, control=True))


def mismatch(where: str) -> str:
    """The one line said when a heal was not bit-exact."""
    return (
        f"the shared state differs between sites after the heal at {where}: the joiner is left out"
    )
