"""Admission by secret: only sites holding the run's secret take part; forged requests, round
hints and heals change nothing (unit checks, then real processes on a lighthouse)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import rounds_site
import torch
from conftest import SiteProcess

from lowcomm.elastic.admission import Admission, read_secret, run_key
from lowcomm.elastic.messages import Request
from lowcomm.errors import ConfigError


def _request(site: int, **more) -> dict:
    return {"site": site, "tag": "sync@10", "phase": "sync", "gen": 0, "run": "r", "inc": "a",
            "join": False, "join_from": 0, "lh": 0, **more}  # fmt: skip


def screened(a: Admission, data: list[dict]) -> list[dict]:
    """``a.screen`` of these requests, each read from the wire first, as sent (with its MAC)."""
    read = [Request.from_wire(d) for d in data]
    kept = a.screen([r for r in read if r is not None])
    return [{**r.signed, **({"mac": r.mac} if r.sealed else {})} for r in kept]


def test_the_run_key_is_hkdf_of_the_secret_with_the_run_id():
    """RFC 5869's HKDF-SHA256 computed apart (extract, then one block of expand)."""
    import hashlib
    import hmac

    prk = hmac.new(b"lowcomm run key v1", b"s3cret", hashlib.sha256).digest()
    want = hmac.new(prk, b"run-a\x01", hashlib.sha256).digest()
    assert run_key(b"s3cret", "run-a") == want
    assert run_key(b"s3cret", "run-b") != want and run_key(b"other", "run-a") != want


def test_a_request_sealed_under_the_secret_passes_and_every_altered_field_fails():
    a = Admission(0, "r", b"s3cret")
    sealed = a.seal(_request(1))
    assert screened(a, [sealed]) == [sealed]
    for field, value in [("tag", "sync@20"), ("phase", "commit"), ("gen", 1), ("site", 2),
                         ("inc", "b"), ("lh", 1), ("ok", False), ("run", "other")]:  # fmt: skip
        assert screened(a, [{**sealed, field: value}]) == [], field
    assert a.ignored == 8
    other_run = Admission(0, "other", b"s3cret").seal(_request(1))
    other_secret = Admission(0, "r", b"nope").seal(_request(1))
    assert screened(a, [other_run, other_secret, _request(1)]) == []


def test_without_a_secret_a_site_reads_only_unsealed_requests():
    plain = Admission(0, "r", None)
    sealed = Admission(1, "r", b"s3cret").seal(_request(1))
    assert plain.seal(_request(0)) == _request(0)
    assert screened(plain, [_request(1), sealed]) == [_request(1)]


@pytest.mark.parametrize(
    "secret, others, says",
    [
        (b"s3cret", b"other", "carry no valid MAC under this site's secret"),
        (None, b"s3cret", "may hold a run secret and this one none"),
        (b"s3cret", None, "may hold no run secret and this one does"),
    ],
)
def test_requests_that_fail_the_mac_decide_nothing_and_only_explain_a_wait_that_ran_out(
    secret, others, says
):
    """Requests claiming the run that fail this site's MAC check (its secret differs from the
    run's, or a stranger sent them: nobody can tell) never stop it: they are ignored, and only
    when its own bounded wait for the run runs out does its line say what they might mean."""
    me = Admission(3, "r", secret)
    run = [Admission(s, "r", others).seal(_request(s)) for s in (0, 1)]
    mine = me.seal(_request(3, join=True))
    assert me.explain() == ""
    assert screened(me, [*run, mine]) == [mine]  # no exception: nothing decided from them
    assert says in me.explain() and "2 requests claiming run r" in me.explain()
    # a member reads the same requests and goes on without the stranger
    member = Admission(0, "r", others)
    assert screened(member, [*run, mine]) == run
    # joiners and other runs' requests claim nothing of this run's membership
    other = Admission(5, "q", others).seal(_request(5, run="q"))
    joiner = Admission(6, "r", others).seal(_request(6, join=True))
    fresh = Admission(3, "r", secret)
    assert screened(fresh, [other, joiner]) == [] and fresh.explain() == ""


def test_a_strangers_junk_stops_no_site_at_the_start():
    """The finding: one request as ``site0009`` claiming the run with a bad MAC, read before
    the others arrived, stopped every entering site. Now it is ignored whatever it claims, and
    the good sites' requests are read as before."""
    good = [Admission(s, "r", b"s3cret").seal(_request(s, tag="start")) for s in (0, 1)]
    junk = {**_request(9, tag="start"), "mac": "00" * 32}
    me = Admission(0, "r", b"s3cret", sites=3)
    assert screened(me, [good[0], junk]) == [good[0]]
    assert screened(me, [junk, junk, junk]) == []
    assert screened(me, [*good, junk]) == good
    assert me.ignored == 5


def test_hints_carry_a_mac_bound_to_their_key_and_a_forged_one_reads_as_absent():
    a = Admission(0, "r", b"s3cret")
    stored = a.hint("lowcomm-rounds/5/at1", "1").encode()
    assert a.read_hint("lowcomm-rounds/5/at1", stored) == "1"
    assert a.read_hint("lowcomm-rounds/10/at1", stored) is None  # replayed at another sync
    assert a.read_hint("lowcomm-rounds/5/closed", b"1") is None  # written bare
    assert a.read_hint("lowcomm-rounds/5/closed", b"1") is None  # polled again: counted once
    assert a.ignored == 2
    assert Admission(0, "r", None).read_hint("k", b"1") == "1"


def test_a_round_hint_counts_only_from_a_known_members_current_process():
    """A hint carries its writer's site and process: once the members' processes are known
    (the last quorum), a hint of another process of a member (a recording of an earlier
    session of the same run id, written again) or of a non-member reads as absent."""
    from lowcomm.elastic.rounds import Rounds

    rounds = Rounds.__new__(Rounds)  # the reading alone: no store, no membership
    rounds._incs = {}
    assert rounds._whose("1#3.ab12") == "1"  # no member known yet: nothing to check against
    rounds._incs = {0: "cd34", 3: "ab12"}
    assert rounds._whose("0.25#3.ab12") == "0.25" and rounds._whose(None) is None
    assert rounds._whose("1#3.ffff") is None  # site 3's earlier process
    assert rounds._whose("1#7.ab12") is None and rounds._whose("1") is None  # nobody's


def test_the_secret_comes_from_a_file_or_the_environment_and_bad_ones_say_so(tmp_path, monkeypatch):
    monkeypatch.delenv("LOWCOMM_SECRET", raising=False)
    assert read_secret("") is None
    monkeypatch.setenv("LOWCOMM_SECRET", "from-env")
    assert read_secret("") == b"from-env"
    (tmp_path / "s").write_text("from-file\n")
    assert read_secret(str(tmp_path / "s")) == b"from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="cannot read it"):
        read_secret(str(tmp_path / "missing"))


def test_train_refuses_a_secret_file_without_elastic_and_an_unreadable_one(tmp_path):
    from lowcomm.config import MembershipConfig

    with pytest.raises(ConfigError, match="add elastic=true"):
        MembershipConfig(secret_file=str(tmp_path / "s"))
    with pytest.raises(ConfigError, match="cannot read it"):
        MembershipConfig(elastic=True, secret_file=str(tmp_path / "missing"))


# -- real processes -------------------------------------------------------------------------------
@contextlib.contextmanager
def _lighthouse(join_s: float = 20.0, secret: bytes | None = None) -> Iterator[str]:
    """A lighthouse for one test: lock-step's (it waits for every live site) or, with a short
    ``join_s``, quorum rounds'; with ``secret``, behind its authenticating front (a keyed site
    refuses an open lighthouse)."""
    pytest.importorskip("torchft")
    from lowcomm.train.lighthouse import serve

    options = {"min_replicas": 1, "join_timeout_ms": int(join_s * 1000), "quorum_tick_ms": 20,
               "heartbeat_timeout_ms": 1_000}  # fmt: skip
    server, front = serve("[::]:0" if secret is None else "127.0.0.1:0", options, secret)
    try:
        yield server.address() if front is None else f"http://127.0.0.1:{front.port}"
    finally:
        if front is not None:
            front.stop()
        server.shutdown()


def test_a_site_with_the_secret_heals_and_sites_without_it_or_with_another_are_refused(
    tmp_path, monkeypatch
):
    """Sites 0-2 hold the run's secret (a file), at a keyed lighthouse; site 2 is killed and
    comes back with it, while two strangers ask to join: one with another secret (the
    environment), one with none. Each stranger stops at the lighthouse's front with one line
    (the members never see it), the restarted site heals bit-exactly, and the run ends as the
    plain-torch reference of a kill and a join."""
    from test_elastic import CASES, J_FROM, J_KILL, _site_process, left_at, reference_elastic

    import lowcomm
    from lowcomm.presets import preset_config

    secret = tmp_path / "secret"
    secret.write_text("the run's secret\n")
    monkeypatch.delenv("LOWCOMM_SECRET", raising=False)
    preset, kw, _ = CASES["diloco"]
    with _lighthouse(secret=b"the run's secret") as lh:
        procs = [_site_process(tmp_path, lh, preset, kw, i, kill_at=J_KILL if i == 2 else None,
                               secret_file=str(secret)) for i in range(3)]  # fmt: skip
        back = _site_process(tmp_path, lh, preset, kw, 2, join_from=J_FROM,
                             after_pid=procs[2].pid, secret_file=str(secret))  # fmt: skip
        monkeypatch.setenv("LOWCOMM_SECRET", "another secret")
        # (sites=5: a data shard of their own for the strangers' numbers)
        wrong = _site_process(tmp_path, lh, preset, kw, 3, join_from=J_FROM, sites=5)
        monkeypatch.delenv("LOWCOMM_SECRET")
        none = _site_process(tmp_path, lh, preset, kw, 4, join_from=J_FROM, sites=5)
        everyone = [*procs, back, wrong, none]
        outs = [p.communicate(timeout=180) for p in everyone]
    codes = [p.returncode for p in everyone]
    assert codes == [0, 0, -9, 0, 1, 1], [o[1][-1500:] for o in outs]
    assert "holds another secret than this site's" in outs[4][1].strip().splitlines()[-1]
    assert "carries no valid MAC under the run's secret" in outs[5][1].strip().splitlines()[-1]
    said = "".join(err for _, err in outs[:4])  # the members' (site 2's first process too)
    assert "without a valid MAC" not in said  # the front kept them out
    a, b, c = (torch.load(tmp_path / f"site{i}.pt", weights_only=True) for i in range(3))
    assert torch.equal(a["global"], b["global"]) and torch.equal(a["global"], c["global"])
    assert a["shared"] == b["shared"] == c["shared"] and a["members"] == [0, 1, 2]
    gone, joined = a["events"]
    assert joined["joined"] == [2] and joined["heal_bytes"] > 0
    cfg = preset_config(lowcomm.DiLoCo.strategy, **kw)
    at = int(joined["at"].partition("@")[2])
    glob, _ = reference_elastic(cfg, 50, left_at([gone]), joined={2: at})
    torch.testing.assert_close(a["global"], glob, atol=1e-4, rtol=0)


def _forge(out: Path, steps: int, sites: int, everything: bool) -> None:
    """Into the sites' stores, before any sync, what any process that reaches them (they take
    every TCP client) could write: site 2's sync at step 10 closed, in its store; with
    ``everything``, also every site arrived at every sync, in every store (each site's own hint
    and the counter)."""
    from datetime import timedelta

    import torch.distributed as dist

    while not all((out / f"store{i}").exists() for i in range(sites)):
        time.sleep(0.01)
    for i in range(sites):
        host, port = (out / f"store{i}").read_text().rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        for step in range(1, steps + 1) if everything else []:
            store.add(f"lowcomm-rounds/{step}/arrived", sites)
            for s in range(sites):
                store.set(f"lowcomm-rounds/{step}/at{s}", b"1")
        if i == 2:
            store.set("lowcomm-rounds/10/closed", b"1")
    (out / "go").write_text("")


def _rounds_run(
    out: Path, lighthouse: str, forge: str, env: dict, timeout_s: float = 30.0
) -> list[dict]:
    """Three equal sites of quorum rounds; ``forge``: "" (nothing), "closed" (site 2's sync at
    step 10) or "everything" (see :func:`_forge`); ``timeout_s``: the sites' Elastic's."""
    out.mkdir()
    # equal sites all within the grace window: each does its full rounds
    rounds = {"rounds": "quorum", "quorum": 2, "grace": 2}
    procs = []
    for i in range(3):
        args = dict(index=i, sites=3, lighthouse=lighthouse, out=str(out), preset="DiLoCo",
                    kw={"sync_every": 5, "outer_optimizer": "sgd", "outer_lr": 0.7}, steps=20,
                    rounds=rounds, step_s=0.02, hold=True, timeout_s=timeout_s)  # fmt: skip
        procs.append(SiteProcess(rounds_site.site, args, out, env={**os.environ, **env},
                                 hard_exit=True))  # fmt: skip
    if forge:
        _forge(out, 20, 3, everything=forge == "everything")
    else:
        while not all((out / f"store{i}").exists() for i in range(3)):
            time.sleep(0.01)
        (out / "go").write_text("")
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for e in errs]
    return [torch.load(out / f"site{i}.pt", weights_only=False) for i in range(3)]


def test_forged_round_hints_make_a_site_late_without_a_secret_and_change_nothing_with_one(
    tmp_path,
):
    """Quorum rounds of three equal sites with hints forged into their stores: without a run
    secret, site 2 takes its sync at step 10 for closed and skips it (late); with one, every
    forged hint (that one, and every site arrived at every sync) reads as absent and the run is
    bit for bit the run nobody forged into."""
    from lowcomm.elastic.rounds import LIGHTHOUSE_JOIN_S

    keyed_at = _lighthouse(LIGHTHOUSE_JOIN_S, secret=b"the run's secret")
    with _lighthouse(LIGHTHOUSE_JOIN_S) as lh, keyed_at as keyed_lh:
        # timeout_s=6: site 2's "stale" hint can reach the others before they wait at sync@10,
        # the very sync it skipped; they then wait timeout_s for its arrival there (about one
        # run in two), which the forgery causes and this run does not check
        harmed = _rounds_run(tmp_path / "open", lh, forge="closed", env={"LOWCOMM_SECRET": ""},
                             timeout_s=6)  # fmt: skip
        keyed = {"LOWCOMM_SECRET": "the run's secret"}
        forged = _rounds_run(tmp_path / "forged", keyed_lh, forge="everything", env=keyed)
        clean = _rounds_run(tmp_path / "clean", keyed_lh, forge="", env=keyed)
    assert harmed[2]["late"] >= 1  # the forgery works on an open run
    assert all(s["cut"] == 0 and s["late"] == 0 and s["trained"] == 20 for s in forged)
    assert all(s["ignored"] > 0 for s in forged) and all(s["ignored"] == 0 for s in clean)
    for a, b in zip(forged, clean):
        assert torch.equal(a["global"], b["global"]) and a["shared"] == b["shared"]
