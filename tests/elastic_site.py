"""One site of an elastic test run (a process of its own, forked by tests/test_elastic.py and
test_admission.py through conftest.SiteProcess; ``python elastic_site.py JSON`` runs it too):
DiLoCo-family training on the tiny model with membership on a lighthouse, optionally killing
itself at a step."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import torch
from helpers import adamw, batches, tiny_model

import lowcomm
from lowcomm.elastic import heal
from lowcomm.transport import Transport, TransportWrapper


def site(
    index: int, sites: int, lighthouse: str, out: str, preset: str, kw: dict, steps: int,
    kill_at: int | None, kill_in_sync: bool, join_from: int | None = None,
    after_pid: int | None = None, step_s: float = 0.0, run_id: str = "lowcomm",
    secret_file: str = "", liar: bool = False, dissent: str = "",
) -> None:  # fmt: skip
    """``join_from``: this process joins the running run (from that step), once the process
    ``after_pid`` (the site it replaces) is gone; ``step_s``: a pause per step; ``liar``: its
    replica checksum is a constant (an insider's lie, or a copy whose memory flipped a bit);
    ``dissent``: an insider's commit votes from the 2nd sync on: "fail" (every sync failed) or
    "blame:S" (site S's payload refused)."""
    torch.set_num_threads(1)
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(index, sites)
    elastic = lowcomm.Elastic(lighthouse=lighthouse, site=index, sites=sites, min_workers=2,
                              timeout_s=20, join=join_from is not None,
                              join_from=join_from or 0, run_id=run_id,
                              secret_file=secret_file)  # fmt: skip
    slow = kill_in_sync  # each collective of a sync sleeps first: a death lands inside one
    make = (lambda group, meter: Slow(Transport(group, meter))) if slow else Transport
    sync = getattr(lowcomm, preset)(model, opt, elastic=elastic, transports=make, **kw)
    if liar:
        sync.register_checksum_hook(lambda value: 12345)
    if dissent:
        sync.register_vote_hook(lambda vote: _dissent(vote, dissent))
    while after_pid is not None and _alive(after_pid):
        time.sleep(0.02)
    with sync:
        data.step = sync.step  # a joiner goes on from the run's step (0 for the others)
        for step in range(sync.step + 1, steps + 1):
            time.sleep(step_s)
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
         "shared": heal.digest(sync.state.shared_state_dict()).hex(),
         "members": sync.membership.members, "fragments": sync.fragment_names},
        os.path.join(out, f"site{index}.pt"),
    )  # fmt: skip


class Slow(TransportWrapper):
    """A transport whose collectives each wait 0.3 s first (a slow network)."""

    def all_reduce(self, t, control=False, op="sum"):
        time.sleep(0.3)
        return self.inner.all_reduce(t, control, op)

    def all_gather(self, t, control=False):
        time.sleep(0.3)
        return self.inner.all_gather(t, control)


def _dissent(vote, how: str):
    """This site's commit vote from the run's 2nd sync on (see ``site``): failed, and with
    ``blame:S`` naming site S's payload."""
    if not vote.tag.startswith("sync@") or int(vote.tag[5:]) <= 5:
        return None
    blame = None
    if how.startswith("blame:"):
        blame = (int(how[6:]), "payload from worker 0 has validity flag 127")
    return dataclasses.replace(vote, ok=False, blame=blame)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    import json

    args = json.loads(sys.argv[1])
    site(**args)
