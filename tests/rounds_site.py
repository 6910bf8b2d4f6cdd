"""One site of a quorum-rounds test run (a process of its own, forked by tests/test_rounds.py
and test_admission.py through conftest.SiteProcess; ``python rounds_site.py JSON`` runs it
too): the own loop on the tiny model, driven by the engine's step (a round cut short makes it
jump), optionally slow.

Before every inner step's engine hook it notes the site's global copy, local weights and unsent
steps; when that step synced, it keeps them with the global copy after it, so the test can
recompute each sync's token-weighted merge on its own. It also records, around the engine's
encode and its applying of each result, what each fragment held: the inputs a reference needs
(global copy, local weights, unsent steps, error buffers) and what the engine made of them."""

from __future__ import annotations

import os
import sys
import time

import torch
from helpers import adamw, batches, tiny_model

import lowcomm
from lowcomm.elastic import heal
from lowcomm.errors import MembershipError


def site(
    index: int, sites: int, lighthouse: str, out: str, preset: str, kw: dict, steps: int,
    rounds: dict, step_s: float = 0.0, slow_from: int = 0, hold: bool = False,
    timeout_s: float = 30.0,
) -> None:  # fmt: skip
    """``rounds``: Elastic's quorum-round settings; ``step_s``: seconds of extra compute per
    inner step, from step ``slow_from``; ``hold``: once in the run, write this site's store
    address to OUT/storeN and wait for OUT/go before training (a test writes into the stores);
    ``timeout_s``: Elastic's."""
    torch.set_num_threads(1)
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(index, sites)
    elastic = lowcomm.Elastic(lighthouse=lighthouse, site=index, sites=sites, min_workers=2,
                              timeout_s=timeout_s, **rounds)  # fmt: skip
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
    sends: list[dict] = []
    applies: list[dict] = []
    stopped = ""
    try:
        with sync:
            _record(sync, sends, applies)
            if hold:
                _hold(out, index, sync.membership.membership.store_address)
            while sync.step < steps:
                time.sleep(step_s if sync.step + 1 >= slow_from else 0.0)
                data.step = sync.step  # a round cut short skips its batches
                x, y = data.next()
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if sync.stats.syncs > before["syncs"]:
                    syncs.append({**before, "step": sync.step, "after": sync.global_flat().clone()})
    except MembershipError as e:
        if sync.step < steps:
            raise
        # late for the run's last sync, a site stops alone when it leaves the block (a
        # documented limit of quorum rounds): its record up to there is still checked
        stopped = str(e)
    rounds_ = sync.membership.rounds
    torch.save(
        {"global": sync.global_flat(), "syncs": syncs, "trained": sync.stats.trained_steps,
         "late": rounds_.late_syncs if rounds_ else 0, "cut": rounds_.cut_rounds if rounds_ else 0,
         "shared": heal.digest(sync.state.shared_state_dict()).hex(),
         "shared_but_flags": heal.digest(_but_flags(sync.state.shared_state_dict())).hex(),
         "events": sync.membership.events, "sends": sends, "applies": applies,
         "stopped": stopped, "ignored": sync.membership.membership.admission.ignored,
         "shapes": [[tuple(p.shape) for p in f.params] for f in sync.fragments]},
        os.path.join(out, f"site{index}.pt"),
    )  # fmt: skip


def _hold(out: str, index: int, address: str) -> None:
    with open(os.path.join(out, f"store{index}.tmp"), "w") as f:
        f.write(address)
    os.replace(os.path.join(out, f"store{index}.tmp"), os.path.join(out, f"store{index}"))
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.01)


def _but_flags(shared: dict) -> dict:
    """The shared state less the unsent columns of the control flags kept with results in
    flight: they hold the weights a quorum-rounds sync used, where lock-step keeps the count
    after encoding (0 for the fragments sent); nothing reads them back from there (the done,
    step and non-finite columns are read back, and compared)."""
    from lowcomm.engine.sync import UNSENT

    held = shared["pending"].items()
    pending = {p: {**d, "flags": d["flags"][:, :UNSENT]} for p, d in held}
    return {**shared, "pending": pending}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _record(sync, sends: list[dict], applies: list[dict]) -> None:
    """Wrap the engine's encode and its applying of a result (reads only): each send notes the
    fragment's global copy, local weights, unsent steps and error buffers before it; each
    result applied notes the sync it came from, the fragment before and after, and its error
    buffers after."""
    from lowcomm.engine.sync import STEP

    parts = sync.parts
    comp = parts.compensation

    def errors(frag):
        if comp is None:
            return None
        bufs = [comp.buffer(n) for n in frag.names]
        return _flat(b if b is not None else torch.zeros_like(p)
                     for b, p in zip(bufs, frag.params))  # fmt: skip

    encode, one = parts.encoder.encode, parts.apply.one

    def encode_(frag, step, defer=True):
        # ref: what the pseudo-gradient is measured from (the continue merge's snapshot)
        rec = dict(step=step, p=frag.index, ref=frag.reference.clone(),
                   local=_flat(frag.params), unsent=frag.unsent, ef=errors(frag))  # fmt: skip
        out = encode(frag, step, defer)
        sends.append(rec)
        return out

    def one_(p, reduced, own, event, workers=0, step=0, final=False):
        frag = parts.fragments[p]
        rec = dict(step=sync.step, p=p, sent_at=int(event.flags[0, STEP]), final=final,
                   valid=reduced.valid_workers, glob=frag.global_flat.clone(),
                   local=_flat(frag.params))  # fmt: skip
        one(p, reduced, own, event, workers=workers, step=step, final=final)
        rec.update(glob_after=frag.global_flat.clone(), local_after=_flat(frag.params),
                   ef_after=errors(frag))  # fmt: skip
        applies.append(rec)

    parts.encoder.encode, parts.apply.one = encode_, one_


if __name__ == "__main__":
    import json

    site(**json.loads(sys.argv[1]))
    # its record written: skip the native teardown, as the trainer's sites do (a posting
    # thread still inside a store call at exit has aborted it: "exception not rethrown")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
