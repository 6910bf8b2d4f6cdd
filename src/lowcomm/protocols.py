"""The interfaces the pieces meet at: ``typing.Protocol``s (structural: no base class needed)
and the engine's extension points.

:class:`SyncEngine` is what the trainer asks of an outer-loop implementation: lowcomm's own
:class:`~lowcomm.engine.LowComm`, or another library's run side by side with it (a strategy
that brings its own engine). :class:`SyncHooks` are the points of a sync where code outside the
engine may act (a contribution, a commit vote, a replica checksum); a transport factory
(``LowComm(transports=...)``) makes every transport between workers. The compensation interface
is :class:`lowcomm.compensation.Compensation`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch.utils.hooks import RemovableHandle

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
    a peer library's own)."""

    members: list[int] | None  # the sites of the last sync (or control collective) that stood
    events: list[dict]  # membership changes: the sync, who left or joined, the time lost

    def run(self, tag: str, collectives: Callable[..., Any]) -> Any:
        """Run ``collectives`` (training and buffer transport) on the live sites, as ``tag``."""
        ...


@dataclass
class Contribution:
    """A worker's contribution to one sync as a contribution hook sees it: past the worker's own
    finite check, before error compensation and encoding (see :class:`SyncHooks`)."""

    step: int  # the inner step of the sync
    tensors: list[Any]  # the pseudo-gradient, per tensor: a hook may change them in place
    weights: list[Any]  # the global copy's tensors, in the same order (read only)
    compensate: bool = True  # False: sent as it is, past the error compensation and its buffers


@dataclass(frozen=True)
class CommitVote:
    """What a site says in the commit vote on one attempt of a sync (elastic runs)."""

    tag: str  # the sync (``sync@STEP``) or control collective it settles
    ok: bool  # its collectives completed
    blame: tuple[int, str] | None  # a member whose payload it could not decode, and why
    members: tuple[int, ...]  # the attempt's members, as the quorum gave them


class SyncHooks:
    """Where code outside the engine may act on a sync, as torch's module and optimizer hooks
    do: each ``register_*_hook`` returns a handle whose ``remove()`` takes the hook out again,
    and hooks run in the order they were registered. Nothing is registered by default.

    - contribution hooks, ``hook(c: Contribution) -> None``: see or change a worker's
      pseudo-gradient before it is compensated and encoded (privacy noise, clipping, a test's
      or a benchmark's bad site);
    - vote hooks, ``hook(v: CommitVote) -> CommitVote | None``: the vote this site casts on an
      attempt of a sync (None keeps it);
    - checksum hooks, ``hook(value: int) -> int | None``: the checksum of its global copy this
      site reports at a replica check (None keeps it).
    """

    def __init__(self) -> None:
        # OrderedDicts: a handle holds a weak reference to its registry (a dict takes none)
        self._contribution: OrderedDict[int, Callable[[Contribution], None]] = OrderedDict()
        self._vote: OrderedDict[int, Callable[[CommitVote], CommitVote | None]] = OrderedDict()
        self._checksum: OrderedDict[int, Callable[[int], int | None]] = OrderedDict()

    def register_contribution_hook(self, hook: Callable[[Contribution], None]) -> RemovableHandle:
        """Call ``hook`` on every contribution this worker makes (see the class doc)."""
        return _registered(self._contribution, hook)

    def register_vote_hook(
        self, hook: Callable[[CommitVote], CommitVote | None]
    ) -> RemovableHandle:
        """Let ``hook`` see, and replace, every commit vote this site casts."""
        return _registered(self._vote, hook)

    def register_checksum_hook(self, hook: Callable[[int], int | None]) -> RemovableHandle:
        """Let ``hook`` see, and replace, every replica checksum this site reports."""
        return _registered(self._checksum, hook)

    def contribution(self, c: Contribution) -> Contribution:
        """``c`` after every contribution hook."""
        for hook in list(self._contribution.values()):
            hook(c)
        return c

    def vote(self, vote: CommitVote) -> CommitVote:
        """``vote`` after every vote hook."""
        for hook in list(self._vote.values()):
            vote = hook(vote) or vote
        return vote

    def checksum(self, value: int) -> int:
        """``value`` after every checksum hook."""
        for hook in list(self._checksum.values()):
            got = hook(value)
            value = value if got is None else int(got)
        return value


def _registered(hooks: OrderedDict[int, Any], hook: Callable[..., Any]) -> RemovableHandle:
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


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
