"""Reliability in the engine: non-finite pseudo-gradients left out, streak limit, replica check."""

from __future__ import annotations

import pytest
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


def _nan_on_device_worker(
    rank: int, world: int, strategy: str, extra: dict, h: int, poison: int, defer: bool | None
) -> dict:
    """A preset run of 12 steps (sync_every ``h``) in which worker 1's update turns NaN at step
    ``poison``; ``defer``: the finite check left on the device (in the payload), read first
    (False), or as the engine chooses (None)."""
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    cfg = lowcomm.preset_config(strategy, workers=world, sync_every=h, **extra)
    globals_after = []
    with (engine := lowcomm.LowComm(model, opt, cfg)):
        if defer is not None:
            engine.parts.aggregator.deferred_checks = defer
        for step in range(1, 13):
            x, y = data.next()
            model(x, y).backward()
            if rank == 1 and step == poison:  # the first parameter's fragment syncs here
                next(model.parameters()).grad[0, 0] = float("nan")
            opt.step()
            opt.zero_grad()
            if step % 2 == 0:
                globals_after.append(engine.global_flat().clone())
        agg = engine.parts.aggregator
        deferred = [
            f.index for f in engine.fragments if agg.deferred_checks and agg.takes_device_flag
        ]
    return {"globals": globals_after, "final": flat_params(model), "deferred": deferred,
            "stats": engine.stats.as_dict()}  # fmt: skip


# Streaming's 2 fragments at H = 4 sync the first parameter at steps 4, 8, 12. At overlap 0 a
# result applies at its send (a NaN left in the weights would reach the other fragment through
# the next forward pass, in either mode); at overlap 1 it applies a step later, and the send at
# the last step is applied by the exit's drain.
STREAMING = {"fragments": 2, "blocks_per_fragment": 0}
DEFERRED_CASES = {
    "sparseloco": ("sparseloco", {}, 2, 2),
    "streaming": ("streaming", {**STREAMING, "overlap": 0}, 4, 4),
    "streaming-overlap": ("streaming", {**STREAMING, "overlap": 1}, 4, 4),
    "streaming-drained": ("streaming", {**STREAMING, "overlap": 1}, 4, 12),
}


@pytest.mark.parametrize("case", sorted(DEFERRED_CASES))
def test_a_finite_check_left_on_the_device_leaves_out_as_one_read_first(workers, case):
    """A fixed world sends the finite check in the payload's flag and learns it with the
    result: the same bits, the same counts, the same restart as reading it first, for a result
    applied at its send, a step later, or by the exit's drain."""
    strategy, extra, h, poison = DEFERRED_CASES[case]
    on, off = (
        workers(_nan_on_device_worker, 3, strategy, extra, h, poison, d) for d in (True, False)
    )
    assert on[0]["deferred"] and not off[0]["deferred"]
    for a, b in zip(on, off):
        assert all(torch.equal(x, y) for x, y in zip(a["globals"], b["globals"]))
        assert torch.equal(a["final"], b["final"])
        for k in ("left_out_syncs", "left_out_here"):
            assert a["stats"][k] == b["stats"][k]
    assert [r["stats"]["left_out_here"] for r in on][0::2] == [0, 0]
    assert on[1]["stats"]["left_out_here"] >= 1
    if poison < 12:
        assert all(bool(torch.isfinite(g).all()) for r in on for g in r["globals"])


def test_under_round_overlap_the_finite_check_is_read_first(workers):
    """Round overlap applies a result after the next send, made from the weights the bad
    update left: told only then, the restart would come a sync late, so the engine does not
    defer there (its own choice runs as reading first, bit for bit), and a peer's payload
    flagged not finite is then refused."""
    mine, off = (workers(_nan_on_device_worker, 3, "sparseloco", {"overlap": -1}, 2, 2, d)
                 for d in (None, False))  # fmt: skip
    assert mine[0]["deferred"] == []
    for a, b in zip(mine, off):
        assert torch.equal(a["final"], b["final"])
        assert all(a["stats"][k] == b["stats"][k] for k in ("left_out_syncs", "left_out_here"))
    assert mine[1]["stats"]["left_out_here"] >= 1


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


def test_check_before_apply_learns_a_bound_and_skips_what_is_past_it():
    """The first updates are taken (warm-up), then one above ``bound`` x the median of the
    last ones, or one not finite, is skipped and left out of the history; a checkpoint's copy
    of the history gives a resumed or healed site the same decisions. Off (0): all pass."""
    from lowcomm.engine.check import WARMUP, UpdateCheck
    from lowcomm.engine.state import RunState

    check = UpdateCheck(10.0, RunState())
    for k in range(WARMUP):
        assert check.accept(0, torch.full((4,), 100.0 * (k + 1)), step=k)  # any finite one
    assert check.accept(0, torch.full((4,), 500.0), step=4)  # norm 1000 <= 10 x median 400
    assert not check.accept(0, torch.full((4,), 5000.0), step=5)  # norm 10000 > 10 x 500
    assert not check.accept(0, torch.tensor([1.0, float("nan")]), step=6)
    assert check.accept(1, torch.full((4,), 5000.0), step=6)  # each fragment its own history
    again = UpdateCheck(10.0, RunState())
    again.load(check.save())
    assert again.norms == check.norms and again.skipped == 2
    assert not again.accept(0, torch.full((4,), 5000.0), step=7)
    off = UpdateCheck(0.0, RunState())
    assert off.accept(0, torch.tensor([float("nan")]), step=1)


def _attacked(rank: int, world: int, faults_spec: str, **kw) -> tuple[object, list]:
    """12 steps of DiLoCo (H = 2) on the tiny model, this rank acting out ``faults_spec``;
    the engine and the global copy after each sync."""
    from lowcomm.lab import faults

    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    from lowcomm.lab.faults.harness import Harness
    from lowcomm.transport import Transport

    harness = Harness(faults.parse_faults(faults_spec, world, 12), rank)
    sync = lowcomm.DiLoCo(
        model, opt, sync_every=2, outer_lr=0.7, transports=harness.transports(Transport), **kw
    )
    harness.on_engine(sync)  # as the trainer hands it in
    globals_after = []
    with sync:
        for step in range(1, 13):
            harness.on_step_begin(step)
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if step % 2 == 0:
                globals_after.append(sync.global_flat().clone())
    return sync, globals_after


def _attacked_worker(rank: int, world: int, bound: float) -> dict:
    return {"globals": _attacked(rank, world, "scale:2@7x1000", update_bound=bound)[1]}


def test_a_1000x_site_moves_the_model_unless_the_update_is_checked_before_apply(workers):
    """Site 2 sends its pseudo-gradient x1000 from round 4 on. A plain mean takes it (every
    replica alike, so the replica check cannot tell); with ``update_bound=10`` every site
    skips those outer steps alike and the model stays where the honest rounds left it."""
    plain = workers(_attacked_worker, 3, 0.0)
    checked = workers(_attacked_worker, 3, 10.0)
    for res in (plain, checked):
        assert all(torch.equal(r["globals"][-1], res[0]["globals"][-1]) for r in res)
    g = checked[0]["globals"]
    assert torch.equal(g[3], g[2]) and torch.equal(g[5], g[2])  # rounds 4-6 skipped
    assert torch.equal(plain[0]["globals"][2], g[2])  # the same until the attack
    moved = float((plain[0]["globals"][3] - g[2]).norm())
    honest = float((g[2] - g[1]).norm())
    assert moved > 100 * honest


def test_a_site_that_offends_sync_after_sync_is_named_once_per_streak_and_evicted():
    """Named at its ``syncs``-th offence in a row (above 4x the median norm, or not finite),
    once; an honest sync in between starts its count again, as does a change of sites or a
    sync this site missed; two sites tell nothing apart. With evict, every site excludes it
    from the sync that stood."""
    from types import SimpleNamespace

    from lowcomm.engine.check import Offenders
    from lowcomm.engine.stats import SyncStats

    def synced(norms, sites=None):  # squared norms by site, as the exchange reports them
        return SimpleNamespace(norms={s: v * v for s, v in zip(sites or range(9), norms)})

    stats = SyncStats()
    off = Offenders(2, evict=False, stats=stats)
    bad, fine = [1.0, 1.2, 0.9, 50.0], [1.0, 1.2, 0.9, 1.1]
    assert off.observe(synced(bad), 1) == []
    assert off.observe(synced(fine), 2) == []  # the streak broken
    assert off.observe(synced(bad), 3) == []
    assert off.observe(synced([1.0, 1.2, 0.9, float("inf")]), 4) == [3]
    assert off.observe(synced(bad), 5) == []  # named once per streak
    # site 3 offends on both sides of a change of sites: its count starts again
    assert off.observe(synced(bad + [1.0]), 6) == []
    assert off.observe(synced(bad + [1.0]), 7) == [3]
    assert off.observe(synced([1.0, 50.0]), 8) == [] and off.observe(synced([1.0, 50.0]), 9) == []
    assert stats.extra["offenders"] == {"3": 2}

    rounds = SimpleNamespace(late_syncs=0)  # quorum rounds: a sync this site missed resets
    late = Offenders(2, evict=False, stats=SyncStats(), runner=SimpleNamespace(rounds=rounds))
    assert late.observe(synced(bad), 1) == []
    rounds.late_syncs = 1
    assert late.observe(synced(bad), 3) == []
    assert late.observe(synced(bad), 4) == [3]

    excluded = []
    view = SimpleNamespace(members=[0, 2, 5, 7])
    runner = SimpleNamespace(
        rounds=None, settled=("sync@20", view),
        membership=SimpleNamespace(exclude=lambda sites, tag, v: excluded.append((sites, tag, v))),
    )  # fmt: skip
    evicting = Offenders(1, evict=True, stats=SyncStats(), runner=runner)
    assert evicting.observe(synced(bad, sites=[0, 2, 5, 7]), 20) == [7]
    ((sites, tag, v),) = excluded
    assert list(sites) == [7] and tag == "sync@20" and v is view


def _offending_worker(rank: int, world: int) -> dict:
    sync, globals_after = _attacked(rank, world, "scale:3x1000", aggregation="median",
                                    reduce="gather", offender_syncs=2)  # fmt: skip
    return {"offenders": sync.stats.extra.get("offenders"), "global": globals_after[-1]}


def test_every_site_names_the_same_offender_on_real_processes(workers):
    """Four sites, site 3 sends x1000 from the start: at the second sync every site names
    it, the same, once; the median keeps the replicas identical."""
    res = workers(_offending_worker, 4)
    assert [r["offenders"] for r in res] == [{"3": 1}] * 4
    assert all(torch.equal(r["global"], res[0]["global"]) for r in res)
