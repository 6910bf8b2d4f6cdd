"""The interfaces the pieces meet at, as ``typing.Protocol``s (structural: no base class needed).

:class:`SyncEngine` is what the trainer asks of an outer-loop implementation: lowcomm's own
:class:`~lowcomm.engine.LowComm`, or a peer library's run side by side with it
(:mod:`lowcomm.peers.torchft`). The compensation interface is
:class:`lowcomm.compensation.Compensation`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable


class Meter(Protocol):
    """Running byte and time totals (see :class:`lowcomm.transport.ByteMeter`)."""

    blocked_s: float

    def as_dict(self) -> dict[str, Any]:
        """A plain-dict snapshot."""
        ...


class HasMeter(Protocol):
    """Anything that moves training bytes and meters them."""

    meter: Meter


@runtime_checkable
class SyncEngine(Protocol):
    """An outer loop around (model, inner optimizer) that the reference trainer can drive."""

    transport: Any  # has ``.meter`` (a :class:`Meter`) once started
    stats: Any  # a :class:`lowcomm.engine.SyncStats`
    last_sync_step: int  # the last inner step at which anything was sent or applied

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

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        ...
