"""The fault campaign (`lowcomm bench chaos`): its schedules, its checker, and one run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowcomm.lab.bench.chaos import MIN_WORKERS, Schedule, check, draw, run_one
from lowcomm.lab.faults import parse_faults

METHODS, ROUNDS = ["diloco", "streaming", "sparseloco", "co2"], ["lockstep", "quorum"]


def test_a_seed_draws_one_schedule_that_never_leaves_too_few_sites():
    for seed in range(300):
        a, b = (draw(seed, METHODS, ROUNDS, 4, 100) for _ in range(2))
        assert a == b  # reproducible from the seed alone
        assert a.method == METHODS[seed % 4] and a.rounds == ROUNDS[(seed // 4) % 2]
        parse_faults(",".join(a.faults), 4, 100)  # the trainer's own grammar accepts it
        # slow and add take no site away; lighthouse: kills the lighthouse, not its site
        stay = ("slow", "add", "lighthouse")
        away = {f.split(":")[1].split("@")[0] for f in a.faults if not f.startswith(stay)}
        assert len(away) == a.lost <= 4 - MIN_WORKERS


def test_a_seed_draws_one_adversary_within_the_same_budget_and_the_faults_it_had():
    """Beside its faults a schedule draws one adversary from a stream of its own: an insider
    (a fault of the grammar, taking its site away within the budget) or a stranger (nobody
    away; never where sites sit in namespaces). The faults drawn before stay as they were."""
    from lowcomm.lab.bench.chaos import ADVERSARIES
    from lowcomm.lab.bench.stranger import KINDS as STRANGERS
    from lowcomm.lab.faults import INSIDERS

    seen = set()
    for seed in range(300):
        plain, a = draw(seed, METHODS, ROUNDS, 4, 100), draw(seed, METHODS, ROUNDS, 4, 100,
                                                             ADVERSARIES)  # fmt: skip
        parse_faults(",".join(a.faults), 4, 100)
        kind = a.adversary.split(":")[0]
        seen.add(kind or "none")
        inside = [f for f in a.faults if f.split(":")[0] in INSIDERS]
        lighthouse = [f for f in plain.faults if f.startswith("lighthouse:")]
        assert [f for f in a.faults if f not in inside and not f.startswith("lighthouse:")] == [
            f for f in plain.faults if f not in lighthouse
        ]
        assert a.lost <= 4 - MIN_WORKERS and len(inside) <= 1
        if kind in INSIDERS:
            assert inside == [a.adversary] and a.lost == plain.lost + 1 and a.stranger is None
            site = inside[0].split(":")[1].split("@")[0]  # the lighthouse asked by another site
            assert not any(f.startswith(f"lighthouse:{site}@") for f in a.faults)
        elif kind:
            assert kind in STRANGERS and a.stranger["kind"] == kind and a.lost == plain.lost
            assert not any(f.startswith("link:") for f in a.faults)
        else:
            assert any(f.startswith("link:") for f in a.faults)
        assert "secret_file=/x/secret" in a.command(Path("/x/seed1"))
    assert seen == {*ADVERSARIES, "none"}


def _site(out, site: int, thetas: dict[int, str]) -> None:
    (out / "sites").mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"step": s, "syncs": i, "theta": t}) for i, (s, t) in enumerate(thetas.items())
    ]
    (out / "sites" / f"site{site}.syncs.jsonl").write_text("\n".join(lines) + "\n")


def test_the_checker_reads_a_split_a_needless_stop_and_a_hang_from_the_records(tmp_path):
    sched = Schedule(0, "diloco", "lockstep", 3, 100, ["kill:2@40"], lost=1)
    _site(tmp_path, 0, {10: "a", 20: "b"})
    _site(tmp_path, 1, {10: "a", 20: "c"})  # the same sync, another global copy
    (tmp_path / "summary.json").write_text(json.dumps({"tokens": 1000}))
    found = check(sched, tmp_path, 0, 10.0, 60.0)
    assert len(found) == 1 and found[0].startswith("no split: at step 20")
    _site(tmp_path, 1, {10: "a", 20: "b"})
    assert check(sched, tmp_path, 0, 10.0, 60.0) == []
    assert check(sched, tmp_path, 1, 10.0, 60.0) == ["no needless stop: exit 1 with 2 able sites"]
    assert check(sched, tmp_path, None, 60.0, 60.0)[0].startswith("bounded")
    (tmp_path / "summary.json").write_text(json.dumps({"tokens": 0}))
    assert check(sched, tmp_path, 0, 10.0, 60.0)[0].startswith("accounted")


# 14 s: by hand (-m slow), as the campaign it samples; draw and check are pinned above
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft")
def test_one_seeded_schedule_runs_clean(tmp_path):
    # seed 2: SparseLoCo, lock-step, site 0 (the one that hosts the first group's store and
    # writes the run's files) killed at step 62
    sched = draw(2, METHODS, ROUNDS, 4, 100)
    assert sched.faults == ["kill:0@62"]
    row = run_one(sched, tmp_path / "seed2", limit=180.0)
    assert row["exit"] == 0 and row["violations"] == [], row


def test_a_sites_sync_record_belongs_to_one_run_and_matches_the_replica_checksum(tmp_path):
    import torch

    from lowcomm.engine.guards import checksum
    from lowcomm.train.synclog import SyncLog

    frag = SimpleNamespace(global_flat=torch.arange(5, dtype=torch.float32))
    engine = SimpleNamespace(stats=SimpleNamespace(syncs=0), fragments=[frag])
    old = tmp_path / "sites" / "site1.syncs.jsonl"
    old.parent.mkdir()
    old.write_text('{"step": 10, "syncs": 1, "theta": "0"}\n')  # a run before, same folder
    log = SyncLog(tmp_path, 1, engine, fresh=True)
    log.after_step(3)  # no sync applied: nothing written
    engine.stats.syncs = 1
    log.after_step(4)
    (rec,) = [json.loads(x) for x in old.read_text().splitlines()]
    # an independent reading of the same checksum: the bits as int64 (+ the odd last as int32)
    bits = int(frag.global_flat[:4].view(torch.int64).sum()) + int(
        frag.global_flat[4:].view(torch.int32)
    )
    assert rec == {"step": 4, "syncs": 1, "theta": f"{bits % 2**64:016x}"}
    assert int(rec["theta"], 16) == checksum(frag.global_flat)
    SyncLog(tmp_path, 1, engine, fresh=False)  # a resume or a joiner keeps the record
    assert old.read_text().count("\n") == 1


def test_the_checker_compares_each_shard_of_sites_of_several_ranks_with_the_same_ranks(tmp_path):
    """Rank 0 and rank 1 of a site hold different shards: never a split between them; a shard
    that differs from the same rank's shard of another site is."""
    from lowcomm.lab.bench.records import split as _split

    for site in (0, 1):
        _site(tmp_path, site, {10: "a", 20: "b"})  # rank 0's shard
        (tmp_path / "sites" / f"site{site}.rank1.syncs.jsonl").write_text(
            json.dumps({"step": 10, "syncs": 1, "theta": "x"}) + "\n"
        )  # rank 1's: another shard
    assert _split(tmp_path) == ""
    (tmp_path / "sites" / "site1.rank1.syncs.jsonl").write_text(
        json.dumps({"step": 10, "syncs": 1, "theta": "y"}) + "\n"
    )
    assert _split(tmp_path).startswith("at step 10 (rank1)")


def test_the_deployed_checker_reads_each_sites_folder(tmp_path):
    """lowcomm bench chaos --ranks 2: a site no fault touched must finish; a site brought back
    may instead say the run was over; the finished sites' models must be equal; each shard is
    compared with the same rank's elsewhere."""
    from lowcomm.lab.bench.chaos_sites import SitesSchedule, check

    sched = SitesSchedule(0, "diloco", 3, 2, 100, [{"kind": "rejoin", "site": 2, "rank": 1,
                                                    "sync": 3}], lost=1)  # fmt: skip
    model = {"w": torch.ones(2)}
    for s in range(3):
        _site(tmp_path / f"site{s}", s, {10: "a", 20: "b"})
        torch.save(model, tmp_path / f"site{s}" / "model.pt")
        (tmp_path / f"site{s}" / "summary.json").write_text(json.dumps({"tokens": 1000}))
    (tmp_path / "site2.1.log").write_text("error: site 2 found no run to join at ...")
    assert check(sched, tmp_path, {0: 0, 1: 0, 2: 1}, 60.0) == []  # back too late: said so
    found = check(sched, tmp_path, {0: 0, 1: 1, 2: 0}, 60.0)
    assert found == ["no needless stop: site 1 (no fault) exit 1"]
    torch.save({"w": torch.zeros(2)}, tmp_path / "site1" / "model.pt")
    assert check(sched, tmp_path, {0: 0, 1: 0, 2: None}, 60.0)[1].startswith("same end")
    _site(tmp_path / "site0", 0, {10: "a", 20: "c"})
    assert any(v.startswith("no split: at step 20") for v in
               check(sched, tmp_path, {0: 0, 1: 1, 2: 1}, 60.0))  # fmt: skip


def test_a_stranger_finds_the_run_the_launcher_writes(tmp_path):
    """A campaign's stranger reads the lighthouse and the run id from the launcher's
    DIR/elastic.json, as written today (the settings tree: the run id is membership's). It
    read them from an older layout and, finding none, did nothing in every schedule."""
    from test_trust import _spec

    from lowcomm.lab.bench.stranger import Stranger
    from lowcomm.train.join_site import write_run_file
    from lowcomm.train.site_role import ElasticSite

    spec = _spec(tmp_path, run_id="r7")
    tmp_path.mkdir(exist_ok=True)
    write_run_file(spec, ElasticSite(0, 3, "http://h:1"), "http://h:1", [])
    import threading

    stranger = Stranger("beat", tmp_path, 1, 0.0, 1.0, tmp_path / "captured.jsonl")
    threading.Timer(10.0, stranger.stop.set).start()  # one it cannot read: waits, then None
    assert stranger._wait_for_run() == ("http://h:1", "r7")
    stranger.stop.set()
