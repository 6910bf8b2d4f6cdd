"""The run state, declared once: each owner registers its pieces, everything else is derived.

``state_dict`` (a checkpoint), ``load_state_dict`` (a resume), ``keep`` and ``restore`` (what
leaving the block must not change) all walk the one list of :class:`StatePart`, so a new piece
of state is one ``register`` call beside the code that owns it. What a worker starting afresh
loads (:meth:`RunState.afresh`) and which parts cost model-sized memory
(:meth:`RunState.names`) are declared there too, so no caller outside the engine names parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

CARRIED: Final = object()  # a part's ``fresh``: its saved value carries over to a new world


@dataclass(frozen=True)
class StatePart:
    """One named piece of the run state and how to copy it out and back in."""

    save: Callable[[], Any]  # a copy (tensors and plain types) safe to keep or write to disk
    load: Callable[[Any], None]  # from what ``save`` returned; None when a checkpoint lacks it
    kept: bool = True  # restored after leaving the block (False: counters that go on)
    shared: bool = False  # identical on every live site, so any healthy peer can hand it over
    restore: Callable[[Any], None] | None = None  # how a kept copy goes back, when not ``load``
    share: Callable[[], Any] | None = None  # a shared part as every site holds it (default: save)
    # what it loads when the run resumes on another number of workers and every worker starts
    # afresh from the global copy (its own progress, error buffers and results in flight
    # belong to a world that is gone); CARRIED: the saved value (rank 0's) carries over
    fresh: Any = CARRIED
    buffer: bool = False  # model-sized tensors the engine holds beside the model's own weights


class RunState:
    """The ordered list of state parts; loading follows the order of registration."""

    def __init__(self) -> None:
        self._parts: dict[str, StatePart] = {}

    def register(self, name: str, part: StatePart) -> None:
        """Declare one piece of state under a unique ``name`` (its key in checkpoints)."""
        if name in self._parts:
            raise ValueError(f"state part {name!r} registered twice")
        self._parts[name] = part

    def names(self, shared: bool | None = None, buffer: bool | None = None) -> list[str]:
        """The registered names, in load order; ``shared`` keeps only shared or per-site ones,
        ``buffer`` only those that do (or do not) hold model-sized tensors."""
        return [
            n
            for n, p in self._parts.items()
            if (shared is None or p.shared == shared) and (buffer is None or p.buffer == buffer)
        ]

    def afresh(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` (one worker's state_dict) as a worker of a world of another size loads it:
        each part that declares a ``fresh`` value takes it, the rest carry over."""
        return {**sd, **{n: p.fresh for n, p in self._parts.items() if p.fresh is not CARRIED}}

    def state_dict(self) -> dict[str, Any]:
        """Every part's saved copy, by name."""
        return {name: part.save() for name, part in self._parts.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load every part from ``sd`` in registration order (a missing key loads None).

        A key no part reads is refused: state a checkpoint holds must never be dropped unread.
        """
        unread = sorted(set(sd) - set(self._parts))
        if unread:
            raise ValueError(
                f"engine state has parts this version does not read: {unread}; it was saved "
                f"with other settings or a newer lowcomm (resume it with the run's own settings)"
            )
        for name, part in self._parts.items():
            part.load(sd.get(name))

    def shared_state_dict(self, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """The shared parts as every site holds them (what a joining site is handed), but
        those named in ``skip``."""
        return {
            n: (p.share or p.save)() for n, p in self._parts.items() if p.shared and n not in skip
        }

    def load_shared(self, sd: dict[str, Any]) -> None:
        """Load the shared parts from ``sd`` (a heal), in registration order."""
        for name, part in self._parts.items():
            if part.shared:
                part.load(sd[name])

    def keep(self) -> dict[str, Any]:
        """Copies of the parts that leaving the block must leave as they were."""
        return {name: part.save() for name, part in self._parts.items() if part.kept}

    def restore(self, kept: dict[str, Any]) -> None:
        """Put back what :meth:`keep` copied."""
        for name, value in kept.items():
            part = self._parts[name]
            (part.restore or part.load)(value)
