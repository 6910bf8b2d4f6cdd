"""Trust: no single process, stranger or insider, stops or steers a run. The replica check as a
vote (the minority leaves, the majority goes on), and junk requests that decide nothing (unit
checks, then real processes on a lighthouse)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from lowcomm.engine.guards import ReplicaCheck
from lowcomm.engine.stats import SyncStats
from lowcomm.errors import ReplicaMismatchError


class _Now:
    """A transport whose comm thread runs a job at once (its future done)."""

    def submit(self, fn):
        f: Future = Future()
        f.set_result(fn())
        return f

    def wait(self, f):
        return f.result()


def _check(hashes: list[int], site: int | None, ranks: int = 1):
    """A ReplicaCheck of site ``site`` (None: a fixed world) whose gather returns ``hashes``
    (sites 0.. in order); what it raised and whom its membership excluded."""
    excluded: dict[int, str] = {}
    runner = None
    if site is not None:
        membership = SimpleNamespace(
            ranks=ranks, elastic=SimpleNamespace(site=site),
            exclude=lambda sites, tag, view: excluded.update(sites),
        )  # fmt: skip
        view = SimpleNamespace(members=list(range(len(hashes))))
        runner = SimpleNamespace(membership=membership, current=view)
    gathered = [torch.tensor([h]) for h in hashes]
    group = SimpleNamespace(all_gather=lambda t, control: gathered)
    check = ReplicaCheck(_Now(), lambda tag, fn: fn(group, None), SyncStats(), runner)
    frags = []  # the checksum of no fragment: its value is not what is compared here
    check.start(frags, "check@20")
    try:
        check.collect()
    except ReplicaMismatchError as e:
        return str(e), excluded
    return None, excluded


def test_the_replica_check_is_a_vote_where_the_minority_leaves():
    # three sites, site 2's copy differs: sites 0 and 1 exclude it and go on, site 2 leaves
    for me in (0, 1):
        assert _check([7, 7, 9], me) == (None, {2: _check([7, 7, 9], me)[1][2]})
        assert "differs from the majority's after check@20" in _check([7, 7, 9], me)[1][2]
    said, excluded = _check([7, 7, 9], 2)
    assert excluded == {} and said is not None and "site 2's global parameters differ" in said
    # all agree: nothing happens
    assert _check([7, 7, 7], 1) == (None, {})


@pytest.mark.parametrize("hashes", [[7, 9], [7, 8, 9], [7, 7, 9, 9]])
def test_without_a_majority_the_replica_check_stops_every_site(hashes):
    """Two sites (neither can tell whose copy is wrong), or no copy held by more than half."""
    for me in range(len(hashes)):
        said, excluded = _check(hashes, me)
        assert said is not None and "no copy is held by a majority" in said and not excluded


def test_a_fixed_world_and_sites_of_several_ranks_stop_on_any_mismatch():
    said, _ = _check([7, 7, 9], None)
    assert said is not None and "ranks [2] disagree with rank 0" in said
    said, excluded = _check([7, 7, 9], 0, ranks=2)
    assert said is not None and not excluded


def test_an_insider_with_a_false_checksum_leaves_and_the_honest_sites_finish(tmp_path):
    """The finding: one site whose replica checksum is a constant stopped all three sites at
    the first check. Now the two honest sites exclude it and finish with equal models; the
    liar stops alone with one line."""
    from test_elastic import CASES, _site_process
    from test_admission import _lighthouse

    preset, kw, _ = CASES["diloco"]
    kw = {**kw, "replica_check_every": 2}
    with _lighthouse() as lh:
        procs = [_site_process(tmp_path, lh, preset, kw, i, liar=i == 2) for i in range(3)]
        outs = [p.communicate(timeout=180) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes[:2] == [0, 0] and codes[2] != 0, [o[1][-1500:] for o in outs]
    assert "site 2's global parameters differ from those of a majority" in outs[2][1]
    a, b = (torch.load(tmp_path / f"site{i}.pt", weights_only=True) for i in range(2))
    assert torch.equal(a["global"], b["global"]) and a["members"] == [0, 1]
    (left,) = a["events"]
    assert left["left"] == [2] and left["excluded"] == [2]


def _votes(*votes: dict):
    """A failed attempt of sites 0.. at sync@40 and its complete commit vote: each dict is one
    site's vote (``ok``, and ``blame``/``why`` if it accuses)."""
    from test_protocol import _d, _view

    view = _view(*(_d(s, "sync@40") for s in range(len(votes))))
    commit = _view(*(_d(s, "sync@40", "commit", **v) for s, v in enumerate(votes)))
    return view, commit


BAD = {"ok": False, "blame": 1, "why": "payload from worker 1 has validity flag 127"}


def test_an_exclusion_needs_a_majority_of_the_votes_that_can_judge():
    from lowcomm.elastic.decide import blamed, dissenters

    # a corrupt payload: every other member refuses it alike
    view, commit = _votes(BAD, {"ok": True}, BAD)
    assert blamed(view, commit, 0) == {1: BAD["why"]} and dissenters(view, commit, 0) == []
    # one insider accuses an honest site: nobody corroborates it, nobody is excluded; its vote
    # alone failed the attempt
    view, commit = _votes(BAD, {"ok": True}, {"ok": True})
    assert blamed(view, commit, 0) == {} and dissenters(view, commit, 0) == [0]
    # an insider that says every sync failed
    view, commit = _votes({"ok": True}, {"ok": True}, {"ok": False}, {"ok": True})
    assert blamed(view, commit, 0) == {} and dissenters(view, commit, 0) == [2]
    # half the votes against: no majority either way, nobody is a lone dissenter
    view, commit = _votes({"ok": True}, {"ok": False}, {"ok": False}, {"ok": True})
    assert dissenters(view, commit, 0) == []
    # two sites: one accuser is the majority of its judges (neither can be told apart)
    view, commit = _votes(BAD, {"ok": True})
    assert blamed(view, commit, 0) == {1: BAD["why"]}
    view, commit = _votes({"ok": True}, {**BAD, "blame": 0})
    assert blamed(view, commit, 0) == {0: BAD["why"]}


def test_a_lone_dissenter_is_excluded_after_the_same_failures_not_before():
    from lowcomm.elastic.attempts import LONE_DISSENT, SAME_FAILURES, LockStep, Outcome, Verdict

    view, commit = _votes(BAD, {"ok": True}, {"ok": True})
    policy = LockStep()
    for attempt in range(1, SAME_FAILURES + 1):
        verdict = policy.judged(Outcome(view), Verdict(False, commit, {}, (0,)))
        assert verdict.out == ({0: LONE_DISSENT} if attempt == SAME_FAILURES else {}), attempt
    # another member dissenting in between resets nothing it does not share
    policy = LockStep()
    for lone in [(0,), (2,), (0,)]:
        assert policy.judged(Outcome(view), Verdict(False, commit, {}, lone)).out == {}
