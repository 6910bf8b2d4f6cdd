"""The interfaces the pieces meet at, as ``typing.Protocol``s (structural: no base class needed).

:class:`SyncEngine` is what the trainer asks of an outer-loop implementation: lowcomm's own
:class:`~lowcomm.engine.LowComm`, or a peer library's run side by side with it
(:mod:`lowcomm.peers.torchft`). The compensation interface is
:class:`lowcomm.compensation.Compensation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the engine imports nothing from here at run time
    from .engine.stats import SyncStats
    from .outer import OuterOptimizer


class Meter(Protocol):
    """Running byte and time totals (see :class:`lowcomm.transport.ByteMeter`)."""

    blocked_s: float

    def as_dict(self) -> dict[str, Any]:
        """A plain-dict snapshot."""
        ...


class HasMeter(Protocol):
    """Anything that moves training bytes and meters them."""

    meter: Meter


class Link(HasMeter, Protocol):
    """An engine's transport as the trainer uses it: its meter, and a call run on its comm
    thread behind the syncs queued there (:class:`lowcomm.transport.Transport`)."""

    def blocking(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the comm thread and return its result."""
        ...


class SiteMembership(Protocol):
    """Who is in an elastic run, as the trainer reads it (:class:`lowcomm.elastic.Runner`, or
    :class:`lowcomm.peers.torchft.PeerMembership`)."""

    members: list[int] | None  # the sites of the last sync (or control collective) that stood
    events: list[dict]  # membership changes: the sync, who left or joined, the time lost

    def run(self, tag: str, collectives: Callable[..., Any]) -> Any:
        """Run ``collectives`` (training and buffer transport) on the live sites, as ``tag``."""
        ...


class FaultHooks(Protocol):
    """The points of a sync where a site may act out a fault on itself (tests and chaos runs:
    :class:`lowcomm.faults.Harness`). The engine calls these and holds :data:`NO_FAULTS`
    unless the trainer hands a harness in (``LowComm.faults``); the engine, the aggregators and
    the protocol import no fault code."""

    def contribution(
        self, tensors: list[Any], step: int, compensation: Any, weights: list[Any] | None = None
    ) -> Any:
        """Act on the pseudo-gradient about to be encoded at ``step`` (in place; ``weights``:
        the global copy's tensors, in the same order); returns the compensation to encode it
        through (``compensation``, or None to skip it)."""
        ...

    def outgoing(self, payloads: list[Any]) -> None:
        """Act on a sync's payloads about to be sent (in place)."""
        ...

    def forged(self, payload: Any, shapes: list[Any], rank: int, agg: Any, key: Any) -> Any:
        """The gather payload this site sends in place of ``payload`` (``payload`` itself)."""
        ...

    def gathered(self, shapes: list[Any], rows: list[Any], key: Any) -> None:
        """What every site sent in a gather exchange of group ``key``."""
        ...

    def at(self, point: str) -> None:
        """A named point inside a sync (``collective``) or a heal (``healer``)."""
        ...

    def vote(
        self, tag: str, ok: bool, blame: tuple[int, str] | None, members: list[int]
    ) -> tuple[bool, tuple[int, str] | None]:
        """The commit vote this site casts on ``tag`` among ``members``: (ok, whom it accuses)."""
        ...

    def checksum(self, value: int) -> int:
        """The replica checksum this site reports for its global copy (``value``: the true)."""
        ...


class NoFaults:
    """The fault hooks of a run without faults: nothing happens at any point."""

    def contribution(
        self, tensors: list[Any], step: int, compensation: Any, weights: list[Any] | None = None
    ) -> Any:
        """Nothing to act out: the compensation as it is."""
        return compensation

    def outgoing(self, payloads: list[Any]) -> None:
        """Nothing to spoil."""

    def forged(self, payload: Any, shapes: list[Any], rank: int, agg: Any, key: Any) -> Any:
        """The site's own payload."""
        return payload

    def gathered(self, shapes: list[Any], rows: list[Any], key: Any) -> None:
        """Nothing to keep."""

    def at(self, point: str) -> None:
        """Nothing armed."""

    def vote(
        self, tag: str, ok: bool, blame: tuple[int, str] | None, members: list[int]
    ) -> tuple[bool, tuple[int, str] | None]:
        """The vote as it is."""
        return ok, blame

    def checksum(self, value: int) -> int:
        """The true checksum."""
        return value


#: the hooks every engine holds until a harness is handed in
NO_FAULTS: FaultHooks = NoFaults()


@runtime_checkable
class SyncEngine(Protocol):
    """An outer loop around (model, inner optimizer) that the reference trainer can drive:
    every attribute here is one the trainer reads (so it needs no ``getattr``)."""

    transport: Link | None  # None before lowcomm's engine first starts
    stats: SyncStats
    step: int  # inner steps so far, the run's (a joiner's or a cut-short round's jumps)
    last_sync_step: int  # the last inner step at which anything was sent or applied
    outer: OuterOptimizer | None  # None: a peer library's own outer step, no counters of ours
    membership: SiteMembership | None  # with elastic sites (once started), else None

    def __enter__(self) -> Any:
        """Join the workers and hook the inner optimizer."""
        ...

    def __exit__(self, *exc: Any) -> Any:
        """Leave: consolidate (normal exit) or just unhook (an error)."""
        ...

    def finish(self) -> None:
        """Leave the block normally: every worker ends with the same model."""
        ...

    def global_parameters(self) -> contextlib.AbstractContextManager[Any]:
        """The global parameters loaded into the model for the ``with`` body (evaluation)."""
        ...


@runtime_checkable
class CheckpointableEngine(SyncEngine, Protocol):
    """A :class:`SyncEngine` whose runs can be checkpointed and resumed (lowcomm's own)."""

    def global_state(self) -> dict[str, Any]:
        """The global parameters by name."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This worker's run state, for a checkpoint."""
        ...

    def load_state_dict(self, sd: dict[str, Any], new_world: bool = False) -> None:
        """Continue from :meth:`state_dict`; ``new_world``: on another number of workers
        (every worker starts afresh from the global copy)."""
        ...
