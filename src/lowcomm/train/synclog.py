"""Each elastic site's record of the global copy after every sync it applied
(``DIR/sites/siteN.syncs.jsonl``): what a checker reads to find a split, site by site, without
trusting the run's own verdict (``lowcomm bench chaos``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.guards import global_checksum

if TYPE_CHECKING:
    from ..engine import LowComm
    from ..protocols import SyncEngine


class SyncLog:
    """Appends ``{"step", "syncs", "theta"}`` whenever the engine's sync count grew."""

    def __init__(self, out: Path, site: int, engine: LowComm, fresh: bool) -> None:
        self.engine = engine
        self.path = out / "sites" / f"site{site}.syncs.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:  # a new run into a used folder: an older run's records are not this run's
            self.path.unlink(missing_ok=True)
        self._seen = engine.stats.syncs

    @classmethod
    def of(cls, out: Path, site: int, engine: SyncEngine, fresh: bool) -> SyncLog | None:
        """A log for ``engine``, or None for one that is not lowcomm's (torchft's DiLoCo).
        ``fresh``: the run starts here (not a resume, not a site joining it)."""
        return cls(out, site, engine, fresh) if hasattr(engine, "fragments") else None

    def after_step(self, step: int) -> None:
        """After inner step ``step``: one line if a sync was applied during it."""
        syncs = self.engine.stats.syncs
        if syncs == self._seen:
            return
        self._seen = syncs
        theta = global_checksum(self.engine.fragments)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "syncs": syncs, "theta": f"{theta:016x}"}) + "\n")
