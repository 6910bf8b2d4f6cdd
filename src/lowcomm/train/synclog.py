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


class SyncLog:
    """Appends ``{"step", "syncs", "theta"}`` whenever the engine's sync count grew. In a site
    of several ranks each rank logs its own shard (``siteN.rankR.syncs.jsonl`` beside rank 0's
    ``siteN.syncs.jsonl``): a checker compares each shard with the same rank's elsewhere."""

    def __init__(self, out: Path, site: int, engine: LowComm, fresh: bool, rank: int = 0) -> None:
        self.engine = engine
        shard = f".rank{rank}" if rank else ""
        self.path = out / "sites" / f"site{site}{shard}.syncs.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:  # a new run into a used folder: an older run's records are not this run's
            self.path.unlink(missing_ok=True)
        self._seen = engine.stats.syncs

    def after_step(self, step: int) -> None:
        """After inner step ``step``: one line if a sync was applied during it."""
        syncs = self.engine.stats.syncs
        if syncs == self._seen:
            return
        self._seen = syncs
        theta = global_checksum(self.engine.fragments)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "syncs": syncs, "theta": f"{theta:016x}"}) + "\n")
