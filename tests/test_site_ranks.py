"""Sites of several ranks in an elastic run: each site's own ``torchrun --nproc-per-node 2``,
FSDP2 inside it, one member of the run (its rank 0 asks the lighthouse; the site votes ok only
when every rank completed a sync); each rank syncs its shard with the same rank of the others.

The slow tests run the run as it is deployed: each site in a network namespace of its own (its
own address, a 50 Mbit/s link to the others), started by its own command, nothing shared but
the network; the fast ones pin the site's agreement and the refusals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lowcomm.elastic.messages import Request
from lowcomm.elastic.reading import Reader
from lowcomm.elastic.site import SiteRanks
from lowcomm.errors import MembershipError
from lowcomm.lab.bench.deployed import LOWCOMM, Deployment

TRAIN = ["train", "--strategy", "diloco", "--model", "tiny", "sync_every=10", "progress=false",
         "eval_every=0", "threads=1", "elastic=true", "heartbeat_timeout_s=1",
         "timeout_s=30"]  # fmt: skip


def _agree(rank: int, world: int) -> list:
    site = SiteRanks([0, 1], wait_s=30)
    said = [site.lead(lambda: "from rank 0")]
    try:
        site.lead(lambda: (_ for _ in ()).throw(MembershipError("rank 0 is out")))
    except MembershipError as err:
        said.append(str(err))
    blame = (3, "bad payload") if rank == 1 else None
    said.append(site.vote(rank == 0, blame, [rank + 4]))
    said.append(site.vote(True, None, []))
    said.append(site.worst(rank * 2))
    import lowcomm

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:  # two ranks that do not say they are one site
        lowcomm.DiLoCo(model, opt, elastic=lowcomm.Elastic(lighthouse="127.0.0.1:1", site=0,
                                                           sites=2))  # fmt: skip
    except lowcomm.ConfigError as err:
        said.append(str(err).split(":")[0])
    return said


def test_a_sites_ranks_read_rank_0s_answers_and_vote_ok_only_if_all_completed(workers):
    got = workers(_agree, 2)  # two gloo ranks of one site (forked: conftest's run_workers)
    assert got[0] == got[1]  # every rank of the site reads the same
    assert got[0] == [
        "from rank 0",  # rank 1 never ran the function: rank 0's result
        "rank 0 is out",  # rank 0's error, raised on rank 1 too
        (False, (3, "bad payload"), [4, 5]),  # rank 1 failed: not ok; its blame; both unreached
        (True, None, []),
        2,
        "elastic= in a process group of 2 ranks without mesh=",  # refused before any group
    ]


def test_a_site_of_another_shape_is_refused_with_one_line():
    me = SimpleNamespace(ranks=2, elastic=SimpleNamespace(site=0))
    Reader.same_shape(me, _request({"site": 1, "ranks": 2}))  # the same: fine
    with pytest.raises(MembershipError, match="has 2 ranks but site 1 of the run has 1 rank:"):
        Reader.same_shape(me, _request({"site": 1}))  # a request without it: one rank


# what torchrun --nproc-per-node 2 sets for its first rank (the checks run before any group)
TORCHRUN = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}  # fmt: skip


@pytest.mark.parametrize(
    "extra, env, says",
    [(["--workers", "2", "ranks_per_worker=2"], {}, "launch each site of several ranks"),
     (["site=0", "sites=2", "lighthouse=127.0.0.1:1", "ranks_per_worker=4"],
      TORCHRUN, "this site has 2 ranks"),
     (["site=0", "sites=2", "lighthouse=127.0.0.1:1", "rounds=quorum"], TORCHRUN,
      "rounds=quorum with several ranks per site"),
     (["site=0", "sites=2", "lighthouse=127.0.0.1:1", "ranks_per_worker=2"], {},
      "but this site has 1 rank: a site launched on its own is its torchrun world")],
)  # fmt: skip
def test_sites_of_several_ranks_refuse_what_they_cannot_run(
    tmp_path, capsys, monkeypatch, no_start, extra, env, says
):
    """In this process (conftest's ``no_start``), with torchrun's environment where given;
    test_cli runs the real command's exit status once."""
    from lowcomm import cli

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = cli.main([*TRAIN, "--steps", "20", *extra, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and says in err, err[-1000:]
    assert len(err.strip().splitlines()) == 1


# --- as deployed: namespaces, one torchrun per site -------------------------------------------


def _sites(net, root: Path, sites: int, steps: int, extra: tuple = ()) -> Deployment:
    """A lighthouse in the switch's namespace and sites of 2 ranks, each in its own namespace
    (a "machine": its own address, its uplink shaped), each started by its own command."""

    def train(site: int, lighthouse: str) -> list[str]:
        return [*TRAIN, "--steps", str(steps), f"sites={sites}", f"site={site}",
                "min_workers=2", f"lighthouse={lighthouse}", *extra]  # fmt: skip

    return Deployment(root, 2, train, net, timeout_s=30)


@pytest.fixture
def network():
    from lowcomm.lab.netshape.errors import NetworkUnavailable
    from lowcomm.lab.netshape.namespaces import require_root_and_iproute2
    from lowcomm.lab.netshape.network import ShapedNetwork

    pytest.importorskip("torchft")
    try:
        require_root_and_iproute2()
    except NetworkUnavailable as e:
        pytest.skip(str(e))
    with ShapedNetwork("50mbit", topology="per-worker", workers=3, check=False,
                       name_prefix="lcranks") as net:  # fmt: skip
        yield net


def _models(outs: list[Path]) -> list[dict]:
    return [torch.load(o / "model.pt", weights_only=False) for o in outs]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# three sites of 2 ranks (six processes with FSDP2) on 2 cores: about 2 minutes alone
@pytest.mark.slow
def test_sites_of_two_ranks_in_namespaces_lose_a_rank_leave_whole_and_come_back_healed(
    network, tmp_path
):
    """Rank 1 of site 2 is SIGKILLed after the site's third sync: torchrun stops the site's
    other rank, the whole site leaves and the two others go on; the same command brings it
    back: it joins the run and heals (each rank its own shard, admitted only when every
    shard's digest agrees), and the three sites end with the same parameters. ``--replay`` of
    the run, site 2 started again by the same command when it has left, repeats it bit for
    bit."""
    sites = _sites(network, tmp_path / "run", sites=3, steps=300)
    try:
        for i in range(3):
            sites.start(i)
        while sites.syncs(2) < 3:
            assert sites.procs[2].poll() is None, sites.log(2)
            time.sleep(0.1)
        os.kill(sites.rank_pid(2, 1), signal.SIGKILL)
        assert sites.procs[2].wait(timeout=60) != 0  # torchrun took the site down
        sites.start(2)
        codes = [sites.procs[i].wait(timeout=900) for i in range(3)]
        assert codes == [0, 0, 0], [sites.log(i) for i in range(3)]
    finally:
        sites.close()
    models = _models([sites.out(i) for i in range(3)])
    assert _same(models[0], models[1]) and _same(models[0], models[2])
    import json

    events = [json.loads(x) for x in (sites.out(0) / "membership.jsonl").read_text().splitlines()]
    assert events[0]["left"] == [2] and events[-1].get("joined") == [2], events
    assert events[-1]["heal_bytes"] > 0
    record = sites.out(0) / "membership.jsonl"
    again = _sites(network, tmp_path / "replay", sites=3, steps=300, extra=("--replay", record))
    try:
        for i in range(3):
            again.start(i)
        assert again.procs[2].wait(timeout=300) == 0, again.log(2)  # it left, as recorded
        assert f"will leave after {events[0]['after']}" in again.log(2)
        again.start(2)  # whoever brought it back then brings it back now
        codes = [again.procs[i].wait(timeout=900) for i in range(3)]
        assert codes == [0, 0, 0], [again.log(i) for i in range(3)]
    finally:
        again.close()
    assert f"comes back at {events[-1]['at']}" in again.log(2)
    replayed = _models([again.out(i) for i in range(3)])
    assert all(_same(m, models[0]) for m in replayed)
    assert (again.out(0) / "membership.jsonl").read_text().count('"joined": [2]') == 1


@pytest.mark.slow
def test_two_sites_of_two_ranks_launched_per_site_equal_the_fixed_world_bit_for_bit(
    network, tmp_path
):
    """The same run two ways: two sites of 2 ranks, each its own torchrun in its own namespace
    under the lighthouse; and one fixed world of 2 workers x 2 ranks (``--workers 2
    ranks_per_worker=2``, no membership): the same parameters, bit for bit."""
    sites = _sites(network, tmp_path, sites=2, steps=40)
    try:
        for i in range(2):
            sites.start(i)
        codes = [sites.procs[i].wait(timeout=600) for i in range(2)]
        assert codes == [0, 0], [sites.log(i) for i in range(2)]
    finally:
        sites.close()
    fixed = tmp_path / "fixed"
    done = subprocess.run(
        [*LOWCOMM, *[a for a in TRAIN if a != "elastic=true"], "--steps", "40", "--workers",
         "2", "ranks_per_worker=2", "--out", str(fixed)], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    a, b, c = _models([sites.out(0), sites.out(1), fixed])
    assert _same(a, b) and _same(a, c)


def _request(fields: dict) -> Request:
    """A sync request with ``fields``, read from the wire."""
    got = Request.from_wire({"tag": "sync@10", "phase": "sync", "gen": 0, "join_from": 0, **fields})
    assert got is not None
    return got
