"""Reliability in the engine: non-finite pseudo-gradients left out, streak limit, replica check."""

from __future__ import annotations

import torch
from helpers import adamw, batches, flat_params, local_steps, tiny_model

import lowcomm
from lowcomm.engine import NonFiniteError, ReplicaMismatchError


def _nan_worker(rank: int, world: int, inject_rounds: tuple, patience: int, steps: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.DiLoCo(
        model,
        opt,
        sync_every=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        nesterov=False,
        nonfinite_patience=patience,
    )
    globals_after, locals_after, error = [], [], None
    try:
        with sync:
            for step in range(1, steps + 1):
                x, y = data.next()
                model(x, y).backward()
                if rank == 1 and step % 2 == 0 and step // 2 in inject_rounds:
                    next(model.parameters()).grad[0, 0] = float(
                        "nan"
                    )  # poisons this worker's delta
                opt.step()
                opt.zero_grad()
                if step % 2 == 0:
                    globals_after.append(sync.global_flat().clone())
                    locals_after.append(flat_params(model))
    except NonFiniteError as e:
        error = str(e)
    return {
        "globals": globals_after,
        "locals": locals_after,
        "error": error,
        "stats": sync.stats.as_dict(),
    }


def test_nonfinite_worker_is_left_out_and_restarts(workers):
    world = 3
    res = workers(_nan_worker, world, (1,), 3, 4)
    torch.set_num_threads(1)
    # independent: after round 1 the global copy is the mean of the two healthy workers only
    healthy = []
    for r in (0, 2):
        m = tiny_model(seed=0)
        local_steps(m, adamw(m), batches(r, world), 2)
        healthy.append(flat_params(m))
    expected = (healthy[0] + healthy[1]) / 2
    for r in res:
        assert r["error"] is None
        torch.testing.assert_close(r["globals"][0], expected, atol=1e-6, rtol=0)
        assert torch.isfinite(r["globals"][1]).all()
        assert r["stats"]["left_out_syncs"] == 1
    # the poisoned worker restarted from the global copy and trained on normally
    assert torch.equal(res[1]["locals"][0], res[1]["globals"][0])
    assert res[1]["stats"]["left_out_here"] == 1 and res[0]["stats"]["left_out_here"] == 0
    assert torch.equal(res[1]["globals"][1], res[0]["globals"][1])


def test_nonfinite_streak_stops_every_worker(workers):
    res = workers(_nan_worker, 2, (1, 2), 2, 8)
    for r in res:
        assert r["error"] is not None and "2 syncs in a row" in r["error"]
        assert len(r["globals"]) == 1  # stopped at the second poisoned sync


def _replica_worker(rank: int, world: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.DiLoCo(model, opt, sync_every=2, replica_check_every=1)
    error = None
    try:
        with sync:
            for step in range(1, 7):
                x, y = data.next()
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
                if step == 2 and rank == 1:
                    with torch.no_grad():
                        sync.fragments[0].global_flat[0] += (
                            1.0  # a silent divergence of one replica
                        )
    except ReplicaMismatchError as e:
        error = str(e)
    return {"error": error, "checks": sync.stats.replica_checks}


def test_replica_mismatch_stops_the_run(workers):
    for r in workers(_replica_worker, 2):
        assert r["error"] is not None and "ranks [1]" in r["error"]
        assert r["checks"] >= 1
