"""One site of a quorum-rounds test run (spawned by tests/test_rounds.py): the own loop on the
tiny model, driven by the engine's step (a round cut short makes it jump), optionally slow.

Before every inner step's engine hook it notes the site's global copy, local weights and unsent
steps; when that step synced, it keeps them with the global copy after it, so the test can
recompute each sync's token-weighted merge on its own."""

from __future__ import annotations

import os
import sys
import time

import torch
from helpers import adamw, batches, tiny_model

import lowcomm
from lowcomm.elastic import heal


def site(
    index: int, sites: int, lighthouse: str, out: str, preset: str, kw: dict, steps: int,
    rounds: dict, step_s: float = 0.0, slow_from: int = 0,
) -> None:  # fmt: skip
    """``rounds``: Elastic's quorum-round settings; ``step_s``: seconds of extra compute per
    inner step, from step ``slow_from``."""
    torch.set_num_threads(1)
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(index, sites)
    elastic = lowcomm.Elastic(lighthouse=lighthouse, site=index, sites=sites, min_workers=2,
                              timeout_s=30, **rounds)  # fmt: skip
    sync = getattr(lowcomm, preset)(model, opt, elastic=elastic, **kw)
    syncs: list[dict] = []
    before: dict = {}

    def note(*_) -> None:  # runs before the engine's hook (registered first)
        before.update(
            glob=sync.global_flat().clone(),
            local=torch.cat([p.detach().reshape(-1).float() for f in sync.fragments
                             for p in f.params]),
            covered=sync.fragments[0].unsent + 1, syncs=sync.stats.syncs,
        )  # fmt: skip

    opt.register_step_post_hook(note)
    with sync:
        while sync.step < steps:
            time.sleep(step_s if sync.step + 1 >= slow_from else 0.0)
            data.step = sync.step  # a round cut short skips its batches
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if sync.stats.syncs > before["syncs"]:
                syncs.append({**before, "step": sync.step, "after": sync.global_flat().clone()})
    rounds_ = sync.membership.rounds
    torch.save(
        {"global": sync.global_flat(), "syncs": syncs, "trained": sync.stats.trained_steps,
         "late": rounds_.late_syncs if rounds_ else 0, "cut": rounds_.cut_rounds if rounds_ else 0,
         "shared": heal.digest(sync.state.shared_state_dict()).hex(),
         "events": sync.membership.events},
        os.path.join(out, f"site{index}.pt"),
    )  # fmt: skip


if __name__ == "__main__":
    import json

    site(**json.loads(sys.argv[1]))
