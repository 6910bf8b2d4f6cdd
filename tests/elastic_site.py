"""One site of an elastic test run (spawned by tests/test_elastic.py): DiLoCo-family training
on the tiny model with membership on a lighthouse, optionally killing itself at a step."""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
from helpers import adamw, batches, tiny_model

import lowcomm


def site(
    index: int, sites: int, lighthouse: str, out: str, preset: str, kw: dict, steps: int,
    kill_at: int | None, kill_in_sync: bool,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(index, sites)
    elastic = lowcomm.Elastic(lighthouse=lighthouse, site=index, sites=sites, min_workers=2,
                              timeout_s=20)  # fmt: skip
    delay = 0.3 if kill_in_sync else 0.0
    sync = getattr(lowcomm, preset)(model, opt, elastic=elastic, comm_delay_s=delay, **kw)
    with sync:
        for step in range(1, steps + 1):
            if step == kill_at:
                if kill_in_sync:  # die inside the next sync's collectives (each sleeps first)
                    threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGKILL)).start()
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    torch.save(
        {"global": sync.global_flat(), "events": sync.membership.events,
         "members": sync.membership.members, "fragments": sync.fragment_names},
        os.path.join(out, f"site{index}.pt"),
    )  # fmt: skip


if __name__ == "__main__":
    import json

    args = json.loads(sys.argv[1])
    site(**args)
