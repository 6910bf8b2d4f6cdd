"""Results in flight: exchanges started and not yet applied, by fragment, with the step each
is due at. At most one exchange per fragment is in flight (the schedule guarantees a result
lands before its fragment is sent again)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..aggregate import Reduced
from ..errors import SiteLeft
from ..transport import Transport
from .exchange import UNSENT, Event
from .state import RunState, StatePart

Result = tuple[Reduced, "torch.Tensor | None", Event]  # (average, own send decoded, its event)


@dataclass
class Pending:
    """One fragment's exchange in flight."""

    future: Future  # of an Event
    sent_at: int
    apply_at: int
    own: torch.Tensor | None = None  # continue merge: what this worker sent, decoded


class InFlight:
    """The pending table: submit an exchange, find what is due, take or drain results."""

    def __init__(self, transport: Transport, state: RunState) -> None:
        self.transport = transport
        self.pending: dict[int, Pending] = {}
        # shared: the averages in flight are the same on every site (each one's own send
        # is not, and a joiner has none: see ``shared``)
        # a fresh worker of a world of another size: those results are dropped
        state.register(
            "pending",
            StatePart(self.save, self.load, shared=True, share=self.shared, fresh={}, buffer=True),
        )

    def due(self, step: int, sends: list[int]) -> list[int]:
        """Fragments whose result must be applied now: due at ``step``, or sent again now.

        An exchange that ended this site's part in the run on the comm thread (a replayed
        leave: SiteLeft) is raised here, at the next step, not when its result falls due."""
        for pend in self.pending.values():
            if pend.future.done() and isinstance(pend.future.exception(), SiteLeft):
                raise pend.future.exception()  # type: ignore[misc]
        return sorted(p for p, pend in self.pending.items() if pend.apply_at <= step or p in sends)

    def submit(
        self,
        job: Callable[[], Event],
        step: int,
        apply_at: int,
        owns: dict[int, torch.Tensor | None],
    ) -> None:
        """Start ``job`` on the comm thread; its fragments are applied after ``apply_at``."""
        future = self.transport.submit(job)
        for p, own in owns.items():
            self.pending[p] = Pending(future, step, apply_at, own)

    def own(self, p: int) -> torch.Tensor | None:
        """What this worker sent of fragment ``p`` and has not had back yet (decoded)."""
        pend = self.pending.get(p)
        return pend.own if pend is not None else None

    def take(self, p: int) -> Result:
        """Wait for fragment ``p``'s result and remove it from the table."""
        pend = self.pending.pop(p)
        event = self.transport.wait(pend.future)
        return event.reduced[p], pend.own, event

    def save(self) -> dict[str, Any]:
        """Every result in flight, awaited (not applied early) and stored as tensors."""
        out = {}
        for p in sorted(self.pending):
            pend = self.pending[p]
            event = self.transport.wait(pend.future)
            done: Future = Future()
            done.set_result(event)
            self.pending[p] = dataclasses.replace(pend, future=done)
            # copies: the mean and own send live in buffers the next sends reuse
            own = pend.own.clone() if pend.own is not None else None
            out[str(p)] = {**_entry(p, event, pend.sent_at, pend.apply_at), "own": own}
        return out

    def shared(self) -> dict[str, Any]:
        """The results in flight as every site holds them: without this site's own send (nor
        whether it was left out)."""
        mine = ("own", "left_out")
        return {p: {k: v for k, v in d.items() if k not in mine} for p, d in self.save().items()}

    def load(self, saved: dict[str, Any]) -> None:
        """Replace the table with the results of :meth:`save`."""
        self.pending = {int(p): _pending_from(int(p), d) for p, d in saved.items()}


def _pending_from(p: int, d: dict[str, Any]) -> Pending:
    fut: Future = Future()
    flags = d.get("flags")
    if flags is None:  # checkpoints written before the control flags existed
        flags = torch.zeros((1, UNSENT), dtype=torch.int64)
    told = {"nonfinite": tuple(d.get("nonfinite", ())), "left_out_here": bool(d.get("left_out", 0))}
    reduced = Reduced(d["mean"], int(d["valid_workers"]), **told)
    fut.set_result(Event(flags, {p: reduced}, d.get("buffers")))
    return Pending(fut, int(d["sent_at"]), int(d["apply_at"]), d.get("own"))


def in_hand(results: dict[int, Result], sent_at: int, apply_at: int) -> dict[str, Any]:
    """Results taken from the table and not applied yet, as :meth:`InFlight.shared` gives them
    (a heal at a sync hands over what the sites apply right after sending it)."""
    return {str(p): _entry(p, results[p][2], sent_at, apply_at) for p in sorted(results)}


def _entry(p: int, event: Event, sent_at: int, apply_at: int) -> dict[str, Any]:
    red = event.reduced[p]
    # what the payloads told (a check left on the device), kept only where they told anything
    told: dict[str, Any] = {}
    if red.nonfinite or red.left_out_here:
        told = {"nonfinite": list(red.nonfinite), "left_out": int(red.left_out_here)}
    return {
        "mean": red.mean.clone(),
        "valid_workers": red.valid_workers,
        "flags": event.flags.clone(),
        "buffers": event.buffers,
        "sent_at": sent_at,
        "apply_at": apply_at,
        **told,
    }
