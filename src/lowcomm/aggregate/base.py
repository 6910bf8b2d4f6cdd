"""What every exchange shares: the Encoded/Reduced records, the abstract Aggregator, and
``encode_compensated`` (compensate, encode, record the loss) that works with any of them."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..codecs.base import Codec, PayloadError
from .combine import Combine, SumCombine, check_sum_only, combine_for

if TYPE_CHECKING:  # the math never calls the transport's module, only the object handed in
    from ..compensation import Compensation
    from ..transport import Transport

T = TypeVar("T")

#: a payload's validity flag: it contributes; it sends nothing (a worker left out); it was left
#: out because its update was not finite, found on the device (see Valid) and told peers so
LEFT_OUT, SENT, NONFINITE = 0, 1, 2

#: whether a worker contributes: a bool, or a 0-d bool on the device, its update's finite check
#: not yet read; then the payload goes out flagged by it (NONFINITE when False) and the
#: exchange's one host read tells the host what it held (Reduced.left_out_here)
Valid = bool | torch.Tensor


@dataclass
class Encoded:
    """What one worker contributes to one exchange."""

    payload: torch.Tensor  # what the first collective gets (flag included)
    shapes: list[torch.Size]  # the shapes of the tensors it encodes, in order
    numel: int  # total elements
    local: torch.Tensor | None  # flat FP32 of what peers will decode from us (for compensation)
    key: str | None = None  # names the reduce-side compensation buffer (two-phase)
    shard_numel: int = 0  # two-phase: elements per worker's shard
    out: torch.Tensor | None = None  # flat FP32 the exchange may write its mean into
    # sparse codecs asked for sparse_local: per tensor, (indices, values) peers will decode
    sparse: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # the same for a whole bucket encoded at once: (indices into its tensors one after
    # another, values)
    sparse_flat: tuple[torch.Tensor, torch.Tensor] | None = None
    # error feedback counted this whole message as sent: a weighted exchange hands back what
    # of it the weighted combination did not apply (Reduced.unapplied)
    keep_unapplied: bool = False
    # the device's finite check of this worker's update, where encode was handed one (Valid)
    ok: torch.Tensor | None = None
    # how many workers' payloads are valid, where every worker's control flags said so before
    # the exchange (an all-reduce then reads no count from the device); None: not known
    senders: int | None = None


#: per tensor, a flat FP32 tensor or (flat indices, values): see Reduced.unapplied
Unapplied = list["torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Reduced:
    """The result of one exchange."""

    mean: torch.Tensor  # flat FP32: the rule's combination (the mean) of the valid workers
    valid_workers: int  # how many workers contributed
    # weighted, for an Encoded that keeps it: per tensor, what of this worker's message the
    # weighted combination did not apply, in the unweighted rule's units (Combine.unapplied);
    # None unweighted (all of it was applied) or when this worker sent nothing
    unapplied: Unapplied | None = None
    # tracked (a robust rule on gather, offender_syncs > 0): each sender's (group rank) squared
    # contribution norm, inf where it was not finite or the rule left most of it out (not
    # readable, empty, or against the others); None when not tracked
    norms: dict[int, float] | None = None
    # the senders (group ranks) whose payloads were flagged NONFINITE (their updates found not
    # finite on their devices, so left out), and whether this worker's own was one of them
    nonfinite: tuple[int, ...] = ()
    left_out_here: bool = False


class Aggregator(ABC):
    """Combines flat groups of tensors across workers through one codec, one exchange and one
    combine rule (:mod:`~lowcomm.aggregate.combine`, chosen here, once).

    Subclasses are the exchanges (all-reduce, gather, two-phase); ``method`` names which.
    """

    method: str  # "allreduce", "gather" or "two-phase": for callers that report or branch on it
    sums_only = True  # the exchange can only sum: it runs sum-decomposable rules only
    track = False  # each sender's contribution norm in every result (gather only: Reduced)
    # whether senders leave their update's finite check on the device, a payload then flagged
    # NONFINITE where it fails (the engine decides, see engine.wiring); elsewhere that flag is
    # a peer's bad payload, named as such
    deferred_checks = False

    def __init__(
        self, codec: Codec | None, world_size: int, aggregation: str | Combine = "mean"
    ) -> None:
        self.codec, self.world_size = codec, world_size
        self.rule = combine_for(aggregation)
        if self.sums_only:
            check_sum_only(self.rule, self.method)
        # only the two-phase reduce quantises twice; elsewhere there is nothing to compensate
        self.reduce_compensation: Compensation | None = None
        # seconds inside the collectives of exchange(): the rest of it is decoding and summing
        self.collective_s = 0.0

    @abstractmethod
    def encode(
        self,
        tensors: list[torch.Tensor],
        need_local: bool = False,
        valid: bool = True,
        key: str | None = None,
        slab: torch.Tensor | None = None,
        sparse_local: bool = False,
        flat: torch.Tensor | None = None,
    ) -> Encoded:
        """Encode ``tensors`` (FP32, any shapes); ``need_local`` also returns our decoded view.

        ``valid=False`` sends zeros flagged as "left out": peers average without this worker.
        ``key`` names this group's reduce-side compensation buffer (the same key for the same
        tensors every step); without one the second quantisation is not compensated.
        ``slab``: a flat FP32 buffer whose first elements are ``tensors``, in order, plus one
        spare element; an exchange that can send it as it is takes it as the payload (no copy)
        and may overwrite it. ``sparse_local`` (with ``need_local``): a sparse codec may give
        our decoded view as ``Encoded.sparse`` (per tensor, indices and values) or
        ``Encoded.sparse_flat`` instead of a dense ``local``. ``flat``: the tensors one after
        another in one FP32 buffer, for an exchange that encodes them at once (no copy).
        Runs on the compute thread.
        """

    @abstractmethod
    def exchange(
        self, enc: Encoded, transport: Transport, weights: list[float] | None = None
    ) -> Reduced:
        """Run the collectives and return the rule's flat FP32 combination of the valid workers.

        ``weights`` (one per worker, every worker the same list): the rule weighs each valid
        worker's contribution (the mean: ``sum w_j x_j / sum w_j``); quorum rounds weight each
        site by the inner steps its pseudo-gradient holds.
        The blocking part: it may run on the transport's comm thread.
        """

    @abstractmethod
    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """Bytes this worker hands to the first collective for tensors of ``shapes`` (with flag)."""

    def plan(self, shapes: list[torch.Size], device: torch.device) -> object | None:
        """A plan that encodes a whole bucket of ``shapes`` on ``device`` at once, or None
        (tensor by tensor): the engine then hands :meth:`encode` the bucket as one ``flat``."""
        return None

    def defers(self, shapes: list[torch.Size], device: torch.device, compensated: bool) -> bool:
        """Whether :meth:`encode` takes ``valid`` as a device flag (:data:`Valid`) for a bucket
        of ``shapes`` on ``device`` (through error feedback if ``compensated``), and the
        unweighted :meth:`exchange` reads it with its own result: no host read before it."""
        return False

    def step(self) -> None:
        """Count one optimizer step for the reduce-side buffers (their periodic reset).

        Call it when no exchange is in flight, or queue it on the comm thread after them.
        """
        if self.reduce_compensation is not None:
            self.reduce_compensation.step()

    def _timed(self, collective: Callable[[Any], T], arg: Any) -> T:
        """Run one of the transport's collectives, adding its time to ``collective_s``."""
        t0 = time.perf_counter()
        try:
            return collective(arg)
        finally:
            self.collective_s += time.perf_counter() - t0


def flags_allowed(deferred_checks: bool) -> tuple[int, ...]:
    """The validity flags a payload may carry: NONFINITE only where senders defer their check."""
    return (LEFT_OUT, SENT, NONFINITE) if deferred_checks else (LEFT_OUT, SENT)


def flag(byte: torch.Tensor | float, sender: int, deferred_checks: bool = False) -> int:
    """The validity flag of group rank ``sender``'s payload: SENT, LEFT_OUT or (where senders
    defer their finite check) NONFINITE; PayloadError naming the sender if it is none of them."""
    v = int(byte)
    allowed = flags_allowed(deferred_checks)
    if v not in allowed:
        expected = ", ".join(map(str, allowed[:-1])) + f" or {allowed[-1]}"
        raise PayloadError(
            f"payload from worker {sender} has validity flag {v}, expected {expected}", sender
        )
    return v


def flag_of(valid: Valid) -> torch.Tensor | float:
    """The flag a payload carries for ``valid``: SENT or LEFT_OUT, or on the device SENT or
    NONFINITE (a worker that sends nothing never holds a device flag)."""
    if isinstance(valid, torch.Tensor):
        return torch.where(valid, float(SENT), float(NONFINITE))
    return float(SENT if valid else LEFT_OUT)


def numel(shape: torch.Size) -> int:
    """Elements of ``shape`` (as a Python int)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def encode_compensated(
    aggregator: Aggregator,
    compensation: Compensation | None,
    names: list[str],
    tensors: list[torch.Tensor],
    valid: Valid = True,
    key: str | None = None,
    need_dense: bool = True,
    flat: torch.Tensor | None = None,
) -> Encoded:
    """Compensate, encode and record the loss of one group of named tensors (one collective).

    Per tensor: ``x' = before_send(name, x)``; the group is encoded; then ``after_send(name, x',
    what peers decode of x')``. A group that is not ``valid`` goes out flagged as left out and
    leaves the buffers alone (a non-finite gradient must not pollute them), as does one whose
    device flag (:data:`Valid`) turns out False, through the group's buffers as one. Without
    ``need_dense`` (nobody reads ``Encoded.local``), a compensation that can subtract a sparse
    decode does so at the sent entries only. ``flat`` (the tensors one after another): a
    compensation that keeps the group's buffers as one does the group at once.
    """
    ok = valid if isinstance(valid, torch.Tensor) else None
    comp = compensation if ok is not None or valid else None
    sparse_ok = comp is not None and not need_dense and hasattr(comp, "subtract_sparse")
    whole = getattr(comp, "accumulate_flat", None) if flat is not None else None
    e = whole(names, tensors, flat, ok) if whole is not None else None
    assert ok is None or e is not None, "a device flag needs the group's buffers as one"
    if comp is not None and e is not None:  # the group's buffers as one: no loop over tensors
        to_send = _views(e, tensors)
        enc = aggregator.encode(
            to_send, need_local=True, valid=valid, key=key, sparse_local=sparse_ok, flat=e
        )
        comp.subtract_flat(e, enc)  # type: ignore[attr-defined]
        enc.sparse = enc.sparse_flat = None
        enc.keep_unapplied = hasattr(comp, "restore")
        return enc
    to_send = [comp.before_send(n, t) for n, t in zip(names, tensors)] if comp else list(tensors)
    enc = aggregator.encode(
        to_send, need_local=comp is not None, valid=valid, key=key, sparse_local=sparse_ok
    )
    enc.keep_unapplied = comp is not None and hasattr(comp, "restore")
    if comp is not None and enc.sparse is not None:
        for n, (idx, vals) in zip(names, enc.sparse):
            comp.subtract_sparse(n, idx, vals)  # type: ignore[attr-defined]
        enc.sparse = None
    elif comp is not None:
        assert enc.local is not None
        offset = 0
        for n, h in zip(names, to_send):
            comp.after_send(n, h, enc.local[offset : offset + h.numel()].view_as(h))
            offset += h.numel()
    return enc


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``, one after another."""
    pieces = flat.split([t.numel() for t in like])
    return [p.view(t.shape) for p, t in zip(pieces, like)]


def scaled_unapplied(
    rule: Combine, enc: Encoded, weights: list[float] | None, rank: int
) -> Unapplied | None:
    """A sum rule's :meth:`~.combine.Combine.unapplied` of this worker's message (``enc.local``,
    what peers decode of it), for the exchanges that only sum: per tensor, dense."""
    if weights is None or not enc.keep_unapplied or enc.local is None or weights[rank] <= 0:
        return None
    assert isinstance(rule, SumCombine)
    kept = enc.local * (1.0 - rule.share(weights, rank))
    return list(kept.split([numel(s) for s in enc.shapes]))


def contribution(
    tensors: list[torch.Tensor], valid: bool
) -> tuple[list[torch.Tensor], list[torch.Size], int]:
    """What a worker contributes (zeros when it is left out), their shapes and element count."""
    if not valid:
        tensors = [torch.zeros_like(t) for t in tensors]
    return tensors, [t.shape for t in tensors], sum(t.numel() for t in tensors)
