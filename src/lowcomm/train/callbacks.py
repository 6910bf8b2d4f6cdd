"""Callbacks of the reference trainer: parts handed to a worker's run that act at fixed points
of it, as Hugging Face Trainer callbacks do. A run holds a list of them (none by default);
extensions of the trainer (:mod:`.extensions`) make them in each worker process.

Each method is a no-op here: a callback overrides what it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..transport import Transport, TransportFactory

if TYPE_CHECKING:
    from ..protocols import SyncEngine


class TrainerCallback:
    """A part of one worker's run that acts around its inner steps and on its engine."""

    def transports(self, make: TransportFactory) -> TransportFactory:
        """The factory of every transport between workers, given the one so far (``make``):
        return it, or one that wraps what it makes."""
        return make

    def on_engine(self, engine: SyncEngine) -> None:
        """The run's engine is built (not started): register its hooks here."""

    def on_step_begin(self, step: int) -> None:
        """Inner step ``step`` is about to run."""

    def on_step_end(self, step: int, compute_s: float) -> None:
        """Inner step ``step`` ran; its compute (the sync inside it apart) took ``compute_s``."""


class Callbacks(TrainerCallback):
    """Several callbacks as one, each called in order."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None) -> None:
        self.callbacks = list(callbacks or [])

    def transports(self, make: TransportFactory = Transport) -> TransportFactory:
        """Each callback's factory wrapping the one before (the first wraps ``make``)."""
        for cb in self.callbacks:
            make = cb.transports(make)
        return make

    def on_engine(self, engine: SyncEngine) -> None:
        """Every callback's :meth:`TrainerCallback.on_engine`."""
        for cb in self.callbacks:
            cb.on_engine(engine)

    def on_step_begin(self, step: int) -> None:
        """Every callback's :meth:`TrainerCallback.on_step_begin`."""
        for cb in self.callbacks:
            cb.on_step_begin(step)

    def on_step_end(self, step: int, compute_s: float) -> None:
        """Every callback's :meth:`TrainerCallback.on_step_end`."""
        for cb in self.callbacks:
            cb.on_step_end(step, compute_s)
