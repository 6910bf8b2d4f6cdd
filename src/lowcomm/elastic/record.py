"""The run's record of membership as one site keeps it: who was in the last sync that stood,
each change of members (who left, who joined, what it cost), and the last sync this site was
in. A joiner receives it whole with its heal, so every member's record reads alike."""

from __future__ import annotations

import logging
import time
from typing import Any

from .decide import View
from .messages import is_int

log = logging.getLogger("lowcomm")


class Record:
    """Membership events of the run, in the order the syncs stood."""

    def __init__(self, site: int, say: bool = True) -> None:
        self.site, self.say = site, say  # ``say``: this rank logs changes (one per site)
        self.members: list[int] | None = None  # who took part in the last sync that stood
        self.events: list[dict] = []  # membership changes: step tag, who left, seconds lost
        self.last_tag = "start"  # the last sync that stood with this site in it
        self.last_step = 0  # ... and the last inner step such a sync was at
        self.failed_at: float | None = None  # when this sync's first attempt failed
        # the last heal sent: seconds, the state's bytes, how many members sent them
        self.heal: tuple[float, int, int] | None = None

    def to_wire(self) -> dict:
        """What a joiner receives with its heal."""
        return {"events": self.events, "members": self.members,
                "last": [self.last_tag, self.last_step]}  # fmt: skip

    def load(self, got: Any) -> None:
        """A joiner: take the record its healer sent (read off the wire here, every field
        checked: a malformed one fails the heal)."""
        if not _well_formed(got):
            raise RuntimeError("the heal's membership record is malformed")
        self.events, self.members = list(got["events"]), list(got["members"])
        self.last_tag, self.last_step = got["last"]

    def settle(self, tag: str, view: View, excluded: dict[int, str], started: float) -> None:
        """Sync ``tag`` stood on ``view``: record a change of members (who left, and how long
        the survivors took to sync again, from the first failure or, for a site lost between
        syncs, from ``started`` asking for this sync's quorum; who joined, and what their heal
        cost)."""
        if self.members is not None and view.members != self.members:
            self.events.append(self._event(tag, view, excluded, started))
        self.heal, self.failed_at = None, None
        self.members = list(view.members)
        self.last_tag = tag
        _, _, step = tag.partition("@")
        if step.isdigit():  # a sync of the outer loop (others: flags, checks, control)
            self.last_step = int(step)

    def _event(self, tag: str, view: View, excluded: dict[int, str], started: float) -> dict:
        """The change of members at ``tag``, said once per site."""
        gone = sorted(set(self.members or ()) - set(view.members))
        lost = time.perf_counter() - (self.failed_at or started)
        event = {"at": tag, "after": self.last_tag, "last_step": self.last_step, "left": gone}
        refused = [s for s in gone if s in excluded]
        if refused:  # refused for its payload, not lost: said as such in the record
            event["excluded"] = refused
        event.update(members=list(view.members), resync_s=round(lost, 3))
        if view.joiners:
            event["joined"] = list(view.joiners)
            if self.heal is not None:  # measured by the old members that sent it
                seconds, size, sources = self.heal
                event.update(heal_s=round(seconds, 3), heal_bytes=size, heal_from=sources)
        if gone and self.say:
            log.warning("site %d: sites %s left at %s; %d sites go on", self.site, gone, tag,
                        len(view.members))  # fmt: skip
        if view.joiners and self.say:
            log.warning("site %d: sites %s joined at %s; %d sites go on", self.site,
                        view.joiners, tag, len(view.members))  # fmt: skip
        return event


def _well_formed(got: Any) -> bool:
    """Whether a healer's record has its fields, of their types."""
    last = got.get("last") if isinstance(got, dict) else None
    members, events = (got.get("members"), got.get("events")) if last is not None else (0, 0)
    return (
        isinstance(last, list) and len(last) == 2 and isinstance(last[0], str) and is_int(last[1])
        and isinstance(events, list) and all(isinstance(e, dict) for e in events)
        and isinstance(members, list) and all(is_int(m) for m in members)
    )  # fmt: skip
