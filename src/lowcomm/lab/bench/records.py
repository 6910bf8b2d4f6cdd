"""What elastic sites recorded, checked by the fault campaigns (:mod:`.chaos`,
:mod:`.chaos_sites`) rather than trusted from the run's own verdict."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def split(out: Path) -> str:
    """'' when every site that logged a step logged the same global copy there (in sites of
    several ranks, each shard the same as the same rank's in every other site)."""
    by_step: dict[tuple[int, str], dict[str, str]] = {}
    for f in sorted((out / "sites").glob("site*.syncs.jsonl")):
        site, _, shard = f.name.removesuffix(".syncs.jsonl").partition(".")
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault((int(rec["step"]), shard), {})[site] = rec["theta"]
    for step, shard in sorted(by_step):
        if len(set(by_step[step, shard].values())) > 1:
            return f"at step {step}{' (' + shard + ')' if shard else ''}: {by_step[step, shard]}"
    if not by_step:
        return "no site logged a sync"
    return ""


def model_digest(path: Path) -> str:
    """A short SHA-256 of a saved state dict's names and bytes ("missing" if none)."""
    import torch

    if not path.exists():
        return "missing"
    state = torch.load(path, weights_only=True)
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode() + state[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]
