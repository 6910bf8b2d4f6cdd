"""What every exchange shares: the Encoded/Reduced records, the abstract Aggregator, the
validity flags, and ``encode_compensated`` (compensate, encode, record the loss) that works
with any of them.

An aggregator works on one fragment at a time: its tensors one after another in one flat FP32
buffer, cut into buckets (consecutive tensors), one collective each. Everything but the
collectives runs over the whole fragment at once (the codec's plan, the combine rule), so the
kernel launches of a sync do not depend on how many tensors or buckets it has.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..codecs.base import Codec, PayloadError, Plan
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
    """What one worker contributes to one exchange (one fragment)."""

    payload: torch.Tensor  # what the collectives send, bucket after bucket (flags included)
    shapes: list[torch.Size]  # the shapes of the tensors it encodes, in order
    numel: int  # total elements
    local: torch.Tensor | None  # flat FP32 of what peers will decode from us (for compensation)
    key: str | None = None  # names the reduce-side compensation buffer (two-phase)
    # where each bucket's collective starts in ``payload`` (its last entry: the end)
    splits: list[int] = field(default_factory=list)
    plan: Plan | None = None  # the codec's plan of the whole payload (gather, two-phase)
    flag_at: torch.Tensor | None = None  # where the payload's validity flags are (gather)
    layout: Any = None  # how the exchange laid the payload out (two-phase: its Shards)
    shard_numel: int = 0  # two-phase: elements per worker's shard
    out: torch.Tensor | None = None  # flat FP32 the exchange may write its mean into
    # a sparse codec's own decode, asked for instead of ``local``: (flat indices, values)
    sparse_flat: tuple[torch.Tensor, torch.Tensor] | None = None
    # error feedback counted this whole message as sent: a weighted exchange hands back what
    # of it the weighted combination did not apply (Reduced.unapplied)
    keep_unapplied: bool = False
    # the device's finite check of this worker's update, where encode was handed one (Valid)
    ok: torch.Tensor | None = None
    # how many workers' payloads are valid, where every worker's control flags said so before
    # the exchange (an all-reduce then reads no count from the device); None: not known
    senders: int | None = None


#: flat FP32 over a fragment, or (flat indices, values) with 0 elsewhere: see Reduced.unapplied
Unapplied = "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"


@dataclass
class Reduced:
    """The result of one exchange (one fragment)."""

    mean: torch.Tensor  # flat FP32: the rule's combination (the mean) of the valid workers
    valid_workers: int  # how many workers contributed
    # weighted, for an Encoded that keeps it: what of this worker's message the weighted
    # combination did not apply, in the unweighted rule's units (Combine.unapplied), over the
    # whole fragment; None unweighted (all of it was applied) or when this worker sent nothing
    unapplied: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
    # tracked (a robust rule on gather, offender_syncs > 0): each sender's (group rank) squared
    # contribution norm, inf where it was not finite or the rule left most of it out (not
    # readable, empty, or against the others); None when not tracked
    norms: dict[int, float] | None = None
    # the senders (group ranks) whose payloads were flagged NONFINITE (their updates found not
    # finite on their devices, so left out), and whether this worker's own was one of them
    nonfinite: tuple[int, ...] = ()
    left_out_here: bool = False


class Aggregator(ABC):
    """Combines a fragment across workers through one codec, one exchange and one combine rule
    (:mod:`~lowcomm.aggregate.combine`, chosen here, once).

    Subclasses are the exchanges (all-reduce, gather, two-phase); ``method`` names which.
    """

    method: str  # "allreduce", "gather" or "two-phase": for callers that report or branch on it
    sums_only = True  # the exchange can only sum: it runs sum-decomposable rules only
    track = False  # each sender's contribution norm in every result (gather only: Reduced)
    # whether senders leave their update's finite check on the device, a payload then flagged
    # NONFINITE where it fails (the engine decides, see engine.wiring); elsewhere that flag is
    # a peer's bad payload, named as such
    deferred_checks = False
    # whether encode takes ``valid`` as a device flag (deferred_checks on: see Valid)
    takes_device_flag = False

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
        flat: torch.Tensor,
        shapes: list[torch.Size],
        buckets: list[int],
        valid: Valid = True,
        want: str = "",
        key: str | None = None,
        slab: torch.Tensor | None = None,
    ) -> Encoded:
        """Encode a fragment: ``flat`` holds its tensors of ``shapes`` one after another (FP32);
        ``buckets`` counts the tensors of each collective (consecutive). ``valid=False`` sends
        zeros flagged as left out: peers combine without this worker; a device flag
        (:data:`Valid`, where :attr:`takes_device_flag`) goes out as it is. ``want``: what of
        our own decode the caller needs: "" nothing, "dense" flat FP32 (``Encoded.local``),
        "sparse" a sparse codec's indices and values (``Encoded.sparse_flat``, else ``local``).
        ``key`` names this fragment's reduce-side compensation buffer (the same key every
        sync); ``slab``: ``flat`` with one spare element after it, which an exchange that sends
        the values as they are may take as its payload (and overwrite). Runs on the compute
        thread.
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
        """Bytes this worker hands to the collectives for one bucket of ``shapes``, flag
        included."""

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
    if isinstance(valid, torch.Tensor):  # a flag byte's
        return torch.where(valid, SENT, NONFINITE).to(torch.uint8)
    return float(SENT if valid else LEFT_OUT)


def numel(shape: torch.Size) -> int:
    """Elements of ``shape`` (as a Python int)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n


def tensor_splits(shapes: list[torch.Size], buckets: list[int]) -> list[int]:
    """Where each bucket starts among ``shapes`` (tensor indices; the last entry: the count)."""
    at, out = 0, [0]
    for count in buckets:
        at += count
        out.append(at)
    if at != len(shapes):
        raise ValueError(f"buckets of {buckets} tensors, for {len(shapes)} shapes")
    return out


def encode_tensors(
    aggregator: Aggregator,
    tensors: list[torch.Tensor],
    valid: Valid = True,
    want: str = "",
    key: str | None = None,
) -> Encoded:
    """Encode ``tensors`` (FP32 values of any shapes) as one fragment of one bucket."""
    dev = tensors[0].device if tensors else None
    flat = torch.cat(
        [t.detach().reshape(-1).float() for t in tensors] or [torch.empty(0, device=dev)]
    )
    return aggregator.encode(flat, [t.shape for t in tensors], [len(tensors)], valid, want, key)


def encode_compensated(
    aggregator: Aggregator,
    compensation: Compensation | None,
    names: list[str],
    flat: torch.Tensor,
    shapes: list[torch.Size],
    buckets: list[int],
    valid: Valid = True,
    key: str | None = None,
    need_dense: bool = True,
) -> Encoded:
    """Compensate, encode and record the loss of one fragment's named tensors (``flat``: the
    tensors one after another) through the compensation's buffers as one flat group.

    ``x' = before_send(x)``; the group is encoded; then ``after_send(x', what peers decode of
    x')``. A group that is not ``valid`` goes out flagged as left out and leaves the buffers
    alone (a non-finite gradient must not pollute them), as does one whose device flag
    (:data:`Valid`) turns out False. Without ``need_dense`` (nobody reads ``Encoded.local``),
    a compensation that can subtract a sparse decode does so at the sent entries only.
    """
    ok = valid if isinstance(valid, torch.Tensor) else None
    if compensation is None or (ok is None and not valid):
        return aggregator.encode(flat, shapes, buckets, valid, "dense" if need_dense else "", key)
    sent = compensation.before_flat(names, shapes, flat, ok)
    want = "dense" if need_dense or not compensation.takes_sparse else "sparse"
    enc = aggregator.encode(sent, shapes, buckets, valid, want, key)
    compensation.after_flat(names, shapes, sent, enc)
    enc.sparse_flat = None
    enc.keep_unapplied = compensation.restores
    return enc


def scaled_unapplied(
    rule: Combine, enc: Encoded, weights: list[float] | None, rank: int
) -> torch.Tensor | None:
    """A sum rule's :meth:`~.combine.Combine.unapplied` of this worker's message (``enc.local``,
    what peers decode of it), for the exchanges that only sum: flat over the fragment."""
    if weights is None or not enc.keep_unapplied or enc.local is None or weights[rank] <= 0:
        return None
    assert isinstance(rule, SumCombine)
    return enc.local * (1.0 - rule.share(weights, rank))
