"""The membership protocol's decisions, computed from lighthouse views built by hand.

Every member computes these from the same quorum data, so they must be pure functions of it:
which sync the run is at, who takes part in it, and whether an attempt's commit vote stands.
Each case here is one the lighthouse can hand out and that once split or stopped a run.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lowcomm.elastic.admission import Admission
from lowcomm.elastic.decide import View, admit, admitted_at, blamed, committed, in_sync, run_tag
from lowcomm.elastic.joining import Joiner
from lowcomm.elastic.membership import Elastic, Membership
from lowcomm.elastic.messages import Request, replica_name
from lowcomm.elastic.reading import Reader
from lowcomm.errors import MembershipError

_OPEN = Admission(0, "lowcomm", None)  # a run without a secret: hints as they are


def _d(site: int, tag: str, phase: str = "sync", ok: bool = True, gen: int = 0, **kw) -> dict:
    return {"site": site, "tag": tag, "phase": phase, "ok": ok, "gen": gen, "join": False,
            "join_from": 0, **kw}  # fmt: skip


def _reqs(data: list[dict]) -> list[Request]:
    """These requests, each read from the wire as a member reads it (its attempt and join step
    0 where a test leaves them out)."""
    requests = [Request.from_wire({"gen": 0, "join_from": 0, **d}) for d in data]
    assert all(r is not None for r in requests), data
    return requests  # type: ignore[return-value]


def _view(*data: dict, qid: int = 7) -> View:
    """A quorum of these requests."""
    requests = _reqs(list(data))
    return View(qid, [r.site for r in requests], requests)


class _Checker(Membership):
    """Membership's decisions without a lighthouse or a store."""

    def __init__(self, site: int, sites: int = 4, min_workers: int = 2) -> None:
        self.elastic = Elastic(lighthouse="http://unused", site=site, sites=sites,
                               min_workers=min_workers)  # fmt: skip
        self.excluded, self._excluded_inc, self._blame, self._unreached = {}, {}, None, []
        self.admission = Admission(site, self.elastic.run_id, None, sites)
        self.asking_back_at, self.joiner = "", Joiner(self)
        self.reader, self.last_members = Reader(self.elastic, "", self.admission, 1), []
        self.last_stores, self.reached = {}, None


def test_a_site_paused_past_its_heartbeat_stops_alone_and_the_others_go_on():
    # site 2 was stopped (SIGSTOP) at sync@190; the others went on without it and it came back
    view = _view(_d(0, "sync@200"), _d(1, "sync@200"), _d(2, "sync@190"), _d(3, "sync@200"))
    for site in (0, 1, 3):
        got = _Checker(site).check(view, "sync@200")
        assert got.members == [0, 1, 3]
        assert [d.site for d in got.data] == [0, 1, 3]
    with pytest.raises(MembershipError, match="site 2 is at sync@190 while the run is at sync@200"):
        _Checker(2).check(view, "sync@190")


def test_two_sites_at_different_syncs_the_newest_is_the_run():
    view = _view(_d(0, "sync@40"), _d(1, "sync@30"))
    assert run_tag(view) == "sync@40"
    assert _Checker(0, sites=2, min_workers=1).check(view, "sync@40").members == [0]
    with pytest.raises(MembershipError, match="stops here"):
        _Checker(1, sites=2, min_workers=1).check(view, "sync@30")


def test_too_few_left_in_the_sync_still_stops_the_run():
    view = _view(_d(0, "sync@20"), _d(1, "sync@20"), _d(2, "sync@10"))
    with pytest.raises(MembershipError, match="fewer than min_workers=3"):
        _Checker(0, sites=3, min_workers=3).check(view, "sync@20")


def test_joiners_are_not_counted_as_elsewhere():
    joiner = {"site": 4, "tag": "join", "phase": "join", "ok": True, "join": True}
    view = View(3, [0, 1, 4], _reqs([_d(0, "sync@50"), _d(1, "sync@50"), joiner]), joiners=[4])
    assert run_tag(view) == "sync@50"
    assert in_sync(view, "sync@50") is view


def test_the_commit_stands_only_on_votes_of_the_same_phase_and_attempt():
    attempt = _view(_d(0, "sync@60"), _d(1, "sync@60"), _d(2, "sync@60"))
    votes = [_d(s, "sync@60", phase="commit", gen=1) for s in (0, 1, 2)]
    assert committed(attempt, _view(*votes), generation=1, ok=True)
    # a stale sync-phase request (ok defaults to True) re-registered into the commit quorum
    stale = [*votes[:2], _d(2, "sync@60", phase="sync", gen=1)]
    assert not committed(attempt, _view(*stale), generation=1, ok=True)
    # a commit request of an earlier attempt
    old = [*votes[:2], _d(2, "sync@60", phase="commit", gen=0)]
    assert not committed(attempt, _view(*old), generation=1, ok=True)
    # a member that failed its collectives, or this site itself
    failed = [*votes[:2], _d(2, "sync@60", phase="commit", ok=False, gen=1)]
    assert not committed(attempt, _view(*failed), generation=1, ok=True)
    assert not committed(attempt, _view(*votes), generation=1, ok=False)
    # fewer voters than the attempt had
    assert not committed(attempt, _view(*votes[:2]), generation=1, ok=True)


class _Participant:
    def __init__(self, data):
        self.data = data  # (under its site's name, as a site asks)
        site = data.get("site") if isinstance(data, dict) else None
        run = data.get("run") if isinstance(data, dict) else None
        run = run if isinstance(run, str) else ""
        self.replica_id = replica_name(run, site) if isinstance(site, int) else "site????"
        if isinstance(data, dict) and "name" not in data:  # as a site asks: under its name
            self.data = {**data, "name": self.replica_id}


class _Quorum:
    def __init__(self, *data):
        self.quorum_id, self.participants = 9, [_Participant(d) for d in data]


class _Lighthouse:
    sent_seq = 0  # the seq a Link stamps its last send with (the quorums here hold none)

    def __init__(self, *data):
        self.answer = _Quorum(*data)

    def quorum(self, *_, **__):
        return self.answer

    def adopt(self, epochs):  # a Link learns of lighthouse restarts from the quorum: none here
        pass


def _asker(site: int, *data: dict, fp: str = "run-a") -> Membership:
    m = _Checker(site)
    m.fingerprint, m.asking_back_at, m.generation = fp, "", 0
    m.reader = Reader(m.elastic, fp, m.admission, 1)
    m.store_address, m.incarnation, m._link = "127.0.0.1:1", "x", _Lighthouse(*data)
    return m


def test_malformed_lighthouse_data_is_no_member_instead_of_a_crash():
    good = [_d(s, "sync@10", fp="run-a") for s in (0, 1)]
    bad = [
        {"tag": "sync@10", "phase": "sync", "gen": 0, "join_from": 0, "fp": "run-a"},  # no site
        {**_d(3, "sync@10", fp="run-a"), "join_from": "soon"},
        {**_d(4, "sync@10", fp="run-a"), "site": "4"},
        None,
        [1, 2],  # junk from a process that is no site: no mapping at all
        "junk",
        5,
    ]
    view = _asker(0, *good, *bad).ask("sync@10", True, "sync", join=False, ready=False)
    assert view.members == [0, 1]


def test_a_lighthouse_leaves_junk_untold_and_still_tells_lowcomms_other_warnings(caplog):
    """A site warns of a malformed request; a lighthouse's process (quiet_junk) does not, yet
    a warning of lowcomm's own still reaches its output (it once silenced them all)."""
    import logging

    from lowcomm.elastic.messages import REQUESTS_LOG, quiet_junk

    requests = logging.getLogger(REQUESTS_LOG)
    level = requests.level
    with caplog.at_level(logging.WARNING, logger="lowcomm"):
        assert Request.from_wire("junk") is None
        assert [r.name for r in caplog.records] == [REQUESTS_LOG]
        caplog.clear()
        try:
            quiet_junk()
            assert Request.from_wire([1, 2]) is None
            logging.getLogger("lowcomm").warning("site 0: something the operator should see")
        finally:
            requests.setLevel(level)
    assert [r.getMessage() for r in caplog.records] == ["site 0: something the operator should see"]


def test_a_member_of_another_run_on_the_same_lighthouse_is_no_member():
    data = [_d(0, "sync@10", fp="run-a"), _d(1, "sync@10", fp="run-a"), _d(2, "sync@10", fp="b")]
    view = _asker(0, *data).ask("sync@10", True, "sync", join=False, ready=False)
    assert view.members == [0, 1]
    # a joiner still sees the others' settings, to say why it is refused
    joined = _asker(3, *data).ask("join", True, "join", join=True, ready=False)
    assert joined.members == [0, 1, 2]


def test_a_joiner_and_the_members_agree_on_who_is_in_when_a_member_is_elsewhere():
    # site 3 is back from a pause at an old sync; site 2 asks back in at the run's sync@110
    joiner = {"site": 2, "tag": "join", "phase": "join", "gen": 0, "join": True, "fp": "a",
              "join_from": 0, "join_at": "sync@110", "ok": True}  # fmt: skip
    data = [_d(0, "sync@110", fp="a", ready=True), _d(1, "sync@110", fp="a", ready=True),
            joiner, _d(3, "sync@100", fp="a", ready=False)]  # fmt: skip
    view = View(4, [0, 1, 2, 3], _reqs(data))
    theirs = _Checker(0).check(admit(view, "a", "sync@110", "sync"), "sync@110")
    mine, ref = admitted_at(view, "a")
    assert theirs.members == mine.members == [0, 1, 2]
    assert theirs.joiners == mine.joiners == [2]
    assert ref.tag == "sync@110"


class _HungStore:
    """A peer's store whose process was stopped (SIGSTOP): a write never returns."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def add(self, key, value):
        self.released.wait()

    def set(self, key, value):
        self.released.wait()


def test_a_hung_peer_store_holds_up_no_hint_to_the_other_sites(monkeypatch):
    """Quorum rounds deliver arrival hints to every peer's store. One shared posting thread
    stalled on a hung peer's store, every later hint waited behind it, and every sync after a
    hang waited timeout_s (300 s by default) for arrivals never delivered: a crawl."""
    from lowcomm.elastic import rounds as rounds_mod

    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    good = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    hung, real = _HungStore(), dist.TCPStore

    def store(host, port, is_master=False, timeout=None, **kw):
        return hung if port == 1 else real(host, port, is_master=is_master, timeout=timeout)

    monkeypatch.setattr(rounds_mod.dist, "TCPStore", store)
    elastic = Elastic(lighthouse="http://unused", site=0, sites=3, rounds="quorum")
    membership = SimpleNamespace(elastic=elastic, store=own, admission=_OPEN, incarnation="a1")
    rounds = rounds_mod.Rounds(membership)
    rounds._stores = {0: "own", 1: "127.0.0.1:1", 2: f"127.0.0.1:{good.port}"}  # hung first
    try:
        rounds._post("lowcomm-rounds/60/arrived")
        good.wait(["lowcomm-rounds/60/arrived"], timedelta(seconds=60))
        assert good.add("lowcomm-rounds/60/arrived", 0) == 1
    finally:
        hung.released.set()


def test_a_blamed_site_is_excluded_by_every_member_from_one_complete_vote():
    """The accusation rides in the commit vote; every member reads the same vote, so all
    exclude the same site, and only from a vote every member of the attempt cast."""
    view = _view(_d(0, "sync@40"), _d(1, "sync@40"), _d(2, "sync@40"))
    why = "payload from worker 1 has validity flag 127, expected 0 or 1"
    accuse = {"blame": 1, "why": why}
    votes = [_d(0, "sync@40", "commit", ok=False, **accuse), _d(1, "sync@40", "commit"),
             _d(2, "sync@40", "commit", ok=False, **accuse)]  # fmt: skip
    assert blamed(view, _view(*votes), generation=0) == {1: why}
    assert blamed(view, _view(*votes[:2]), generation=0) == {}  # site 2 voted elsewhere
    assert blamed(view, _view(*votes), generation=1) == {}  # another attempt's vote
    odd = [_d(0, "sync@40", "commit", blame=7), _d(1, "sync@40", "commit", blame=True),
           _d(2, "sync@40", "commit", blame="1")]  # fmt: skip
    assert blamed(view, _view(*odd), generation=0) == {}  # no member, or not a site number
    for site in (0, 2):
        member = _Checker(site)
        member.exclude(blamed(view, _view(*votes), 0), "sync@40")
        assert member.check(view, "sync@40").members == [0, 2]
    accused = _Checker(1)
    accused.exclude({1: why}, "sync@40")
    with pytest.raises(MembershipError, match="site 1 is excluded from the run at sync@40"):
        accused.check(view, "sync@40")


def _cut(view: View, names: dict[int, list[int]]) -> dict[int, str]:
    """blamed() of a complete failed vote in which site s named ``names[s]`` unreached."""
    votes = [_d(s, "sync@40", "commit", ok=False, inc=f"i{s}", unreached=names.get(s, []))
             for s in view.members]  # fmt: skip
    return blamed(view, _view(*votes), generation=0)


def test_a_site_cut_off_is_excluded_by_every_member_alike_as_the_process_that_voted():
    """Site 2's data plane is cut, its heartbeats still reach the lighthouse: the others name
    it (it never arrived at their store); it reaches no store (its own probes fail) and names
    them all. It alone is left out of the largest set of sites that all reach each other, and
    excluded as the process that voted: a restart of it is another process and may come back."""
    view = _view(*[_d(s, "sync@40", inc=f"i{s}") for s in range(4)])
    out = _cut(view, {0: [2], 1: [2], 2: [0, 1, 3], 3: [2]})
    assert list(out) == [2] and out[2].startswith("unreachable: it and [0, 1, 3] could not")
    for site in (0, 1, 3):
        member = _Checker(site)
        member.exclude(out, "sync@40", view)
        assert member.check(view, "sync@40").members == [0, 1, 3]
        again = _view(*[_d(s, "sync@50", inc="new" if s == 2 else f"i{s}") for s in range(4)])
        assert member.check(again, "sync@50").members == [0, 1, 2, 3]  # started again: back
    cut = _Checker(2)
    cut.exclude(out, "sync@40", view)
    with pytest.raises(MembershipError, match="site 2 is excluded from the run at sync@40: unre"):
        cut.check(view, "sync@40")


def test_the_store_host_cut_off_is_excluded_and_the_sites_that_lost_only_it_stay():
    # site 0 hosts the group's store and is cut: the others fail to reach the store, probe the
    # members' own stores and name only site 0; site 0 saw nobody arrive and names them all
    view = _view(*[_d(s, "sync@40") for s in range(3)])
    assert list(_cut(view, {0: [1, 2], 1: [0], 2: [0]})) == [0]


def test_only_a_majority_that_all_reach_each_other_goes_on_never_a_side_of_a_split():
    four = _view(*[_d(s, "sync@40") for s in range(4)])
    # {0} | {1, 2, 3}: the larger side goes on, the store host alone is left out
    assert list(_cut(four, {0: [1, 2, 3], 1: [0], 2: [0], 3: [0]})) == [0]
    # {0, 1, 2} | {3} where 3 named only the store host: 3 is still the one left out
    assert list(_cut(four, {0: [3], 1: [3], 2: [3], 3: [0]})) == [3]
    # {0, 1} | {2, 3}: no side holds a majority: nobody is excluded (no split brain)
    assert _cut(four, {0: [2, 3], 1: [2, 3], 2: [0, 1], 3: [0, 1]}) == {}
    # two sites that cannot reach each other (chaos seed 15 paired a cut site 0 with each
    # healthy site in turn): neither goes on alone
    two = _view(_d(0, "sync@40"), _d(2, "sync@40"))
    assert _cut(two, {0: [2], 2: [0]}) == {}
    # two sites cut of three: the healthy one alone is no majority either
    three = _view(*[_d(s, "sync@40") for s in range(3)])
    assert _cut(three, {0: [1, 2], 1: [0, 2], 2: [0, 1]}) == {}


def test_unreached_names_that_exclude_nobody_or_are_junk_change_nothing():
    three = _view(*[_d(s, "sync@40") for s in range(3)])
    assert _cut(three, {}) == {}  # a failed collective names nobody
    odd = {0: [0, 9, "1", True], 2: 7}  # itself, no member, not a site number, not a list
    votes = [_d(s, "sync@40", "commit", unreached=odd.get(s, [])) for s in range(3)]
    assert blamed(three, _view(*votes), 0) == {}
    # a vote missing a member's (it died) is incomplete: nobody is excluded from it
    assert (
        blamed(three, _view(*[_d(s, "sync@40", "commit", unreached=[1]) for s in (0, 2)]), 0) == {}
    )


def test_a_joiner_the_members_cannot_reach_is_excluded_from_the_members_vote():
    """A joiner votes in no commit: the members' vote is complete without it, and a joiner
    they all name is left out (before, it was admitted and failed at every attempt)."""
    joiner = {"site": 3, "tag": "join", "phase": "join", "ok": True, "join": True, "inc": "j"}
    data = _reqs([_d(0, "sync@50"), _d(1, "sync@50"), _d(2, "sync@50"), joiner])
    view = View(3, [0, 1, 2, 3], data, joiners=[3])
    votes = [_d(s, "sync@50", "commit", ok=False, unreached=[3]) for s in range(3)]
    assert list(blamed(view, _view(*votes), 0)) == [3]


def test_a_member_that_never_reaches_a_new_group_is_named_by_the_others():
    """arrive's timeout says which ranks never came (what the commit vote then carries)."""
    from lowcomm.elastic.groups import Unreachable, arrive

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("arrived/1", b"1")  # rank 1 came; rank 2 never does
    with pytest.raises(Unreachable) as got:
        arrive(store, 0, 3, connect_s=0.3)
    assert got.value.ranks == [2]


def test_a_syncs_deadline_follows_the_slowest_sync_that_stood_and_is_whole_after_a_failure():
    """A collective waits 4x the slowest attempt that stood (at least connect_s, at most
    timeout_s); the first sync, a heal and the attempt after a failure wait timeout_s."""
    from lowcomm.elastic.runner import Runner

    runner = Runner.__new__(Runner)
    runner.membership = SimpleNamespace(elastic=Elastic(lighthouse="http://unused", site=0,
                                        sites=3, timeout_s=300, connect_s=10))  # fmt: skip
    runner._slowest, runner._full = 0.0, True
    view = _view(_d(0, "sync@10"), _d(1, "sync@10"))
    assert runner.deadline(view) == 300  # no sync has stood yet
    runner._full = False
    runner._slowest = 0.2
    assert runner.deadline(view) == 10  # connect_s at least
    runner._slowest = 7.0
    assert runner.deadline(view) == 28
    runner._slowest = 100.0
    assert runner.deadline(view) == 300  # timeout_s at most
    runner._slowest = 0.2
    view.joiners = [1]
    assert runner.deadline(view) == 300  # a heal moves the whole state


def test_a_quorum_filled_up_by_a_member_at_another_sync_is_asked_again():
    """Chaos seed 4 (quorum rounds, site 1 cut off, site 0 hung): site 1, still at sync@40,
    asked the lighthouse within site 2's window for sync@50, so site 2's quorum was [1, 2]: two
    sites, enough for min_workers=2, so it was not asked again; but site 1 is at another sync,
    and check() then found site 2 alone and stopped it ("only 1 sites remain"), while site 3,
    alive, was one window away. Counted as check() counts, the quorum is asked again."""
    answers = [
        _view(_d(1, "sync@40"), _d(2, "sync@50")),
        _view(_d(2, "sync@50"), _d(3, "sync@50")),
    ]

    class Scripted(_Checker):
        def _member_view(self, tag, ok, phase, ready):
            return answers.pop(0)

    member = Scripted(2)
    member.elastic = Elastic(lighthouse="http://unused", site=2, sites=4, min_workers=2,
                             heartbeat_s=0.01)  # fmt: skip
    view = member.quorum("sync@50")
    assert member.check(view, "sync@50").members == [2, 3]


def test_a_vote_on_another_attempt_is_no_member_of_the_quorum_a_site_asks_for():
    """Chaos seed 15 (quorum rounds, the store host cut off): site 2's commit vote on a failed
    attempt landed in the quorum site 3 asked for its next attempt; site 3 then waited on a
    group site 2 was never going to join, and the pairs of sites failed each other until all
    stopped. A member reads a quorum without the votes in it, as a joiner does."""
    from lowcomm.elastic.decide import asking

    vote = _d(2, "sync@50", "commit", ok=False, gen=0)
    view = _view(vote, _d(3, "sync@50", gen=1))
    assert asking(view).members == [3]

    class Scripted(_Checker):
        def ask(self, tag, ok, phase, join, ready):
            return view

    member = Scripted(3)
    member.fingerprint, member._refused = "fp", set()
    assert member._member_view("sync@50", True, "sync", False).members == [3]
    joiner = {"site": 4, "tag": "join", "phase": "join", "ok": True, "join": True}
    assert asking(_view(vote, _d(3, "sync@50"), joiner)).members == [3, 4]


def test_the_members_of_a_quorum_run_the_highest_attempt_any_of_them_reports():
    """Chaos seed 32 (a healer killed inside a rejoining site's hand-over): one member counted
    one failed vote fewer than the others, named its next group by another attempt, and the
    three waited at different groups until all stopped. Every member takes the highest
    attempt in the quorum, the same number from the same view."""
    from lowcomm.elastic.decide import attempt_of

    joiner = {"site": 0, "tag": "join", "phase": "join", "ok": True, "join": True, "gen": 9}
    data = _reqs([joiner, _d(2, "sync@60", gen=3), _d(3, "sync@60", gen=2)])
    view = View(4, [0, 2, 3], data, joiners=[0])
    assert attempt_of(view) == 3  # a joiner's own count is no attempt of the run's
    # an attempt that is no number: the request is no member's, read off the wire
    assert Request.from_wire(_d(2, "sync@60", gen=True)) is None
    assert Request.from_wire(_d(3, "sync@60", gen="7")) is None


def test_a_quorum_too_small_after_the_lighthouse_held_it_a_while_is_still_asked_again():
    """Chaos seed 15 again (at 8c1cee0): site 2 asked for sync@50 while the others' pair held
    the lighthouse's quorum; the lighthouse held its lone request (no majority of the live
    sites) for timeout_s, then answered it alone, and the re-ask deadline, counted from the
    request, had passed: site 2, healthy, stopped ("only 1 sites remain"). The deadline counts
    from the first answer that is too small."""
    answers = [_view(_d(2, "sync@50")), _view(_d(2, "sync@50"), _d(3, "sync@50"))]

    class Held(_Checker):
        def _member_view(self, tag, ok, phase, ready):
            if len(answers) == 2:
                time.sleep(0.3)  # the lighthouse held this request longer than timeout_s
            return answers.pop(0)

    member = Held(2)
    member.elastic = Elastic(lighthouse="http://unused", site=2, sites=4, min_workers=2,
                             heartbeat_s=0.01, timeout_s=0.2)  # fmt: skip
    view = member.quorum("sync@50")
    assert member.check(view, "sync@50").members == [2, 3]


class _Split(_Checker):
    """Site 3 at sync@50: its first attempt on [0, 3] fails, the two could not reach each
    other; its next quorums are scripted, and what it asks with is recorded."""

    def __init__(self, after: list[View]) -> None:
        super().__init__(3)
        self.elastic = Elastic(lighthouse="http://unused", site=3, sites=4, min_workers=2,
                               heartbeat_s=0.01, timeout_s=5)  # fmt: skip
        self.generation, self.splits, self.asked = 0, [], 0
        self.sync = [_view(_d(0, "sync@50"), _d(3, "sync@50")), *after]
        cut = [_d(0, "sync@50", "commit", False, unreached=[3]),
               _d(3, "sync@50", "commit", False, unreached=[0])]  # fmt: skip
        self.commits = [_view(*cut), _view(*(_d(s, "sync@50", "commit", gen=1) for s in (2, 3)))]

    def _member_view(self, tag, ok, phase, ready):
        self.asked += 1
        return self.sync.pop(0) if phase == "sync" else self.commits.pop(0)

    def quorum(self, tag, ok=True, phase="sync", ready=False, blame=None, unreached=None,
               retry=None):  # fmt: skip
        if phase == "sync":
            self.splits.append(list(retry.members) if retry and retry.split else None)
        return super().quorum(tag, ok, phase, ready, blame, unreached, retry)

    def drop(self, key):
        pass


def test_after_a_split_with_no_majority_the_same_pair_is_asked_again_until_a_third_comes():
    """Chaos seeds 15 and 71 (quorum rounds, the store host cut off, one site killed): the
    cut site and one healthy site formed a quorum, failed to reach each other, and neither
    side held a majority to exclude the other; asked again within the lighthouse's half
    second, the same pair came back and failed until both stopped, while the third live site
    was a moment away. The pair is asked again until another site comes (here at once)."""
    from lowcomm.elastic.attempts import QuorumRounds
    from lowcomm.elastic.groups import Unreachable
    from lowcomm.elastic.runner import Runner
    from lowcomm.transport import ByteMeter

    pair = _view(_d(0, "sync@50", gen=1), _d(3, "sync@50", gen=1))
    member = _Split([pair, _view(_d(2, "sync@50", gen=1), _d(3, "sync@50", gen=1))])
    runner = Runner(member, ByteMeter(), ByteMeter())
    # quorum rounds without a lighthouse: their expectations a no-op, their retry policy
    runner.rounds = SimpleNamespace(expect=lambda view, tag: None, back=lambda: None)
    runner._policy = QuorumRounds
    tries = []

    def attempt(view, tag, collectives):
        tries.append(view.members)
        if len(tries) == 1:
            raise Unreachable("could not reach the group's store", ranks=[0])
        return "stood"

    runner._collectives = attempt
    assert runner.run("sync@50", lambda t, b: None) == "stood"
    assert member.splits == [None, [0, 3]]
    assert tries == [[0, 3], [2, 3]]  # the same pair again was not tried
    assert member.asked == 5  # sync, commit, the pair again (asked anew), the trio's, commit


def test_in_lock_step_a_split_is_retried_on_the_lighthouses_next_quorum_at_once():
    """Chaos seed 112 (lock-step, site 0 cut for 20 s, one site killed): after an attempt
    that named no majority, the three members asked again while the lighthouse, which in
    lock-step gathers every live site, kept answering the same three; the first two to run
    out of patience went on to the next attempt, the third asked once more, alone, and
    stopped ("only 1 sites remain"). In lock-step the retry takes the next quorum as it is."""
    from lowcomm.elastic.groups import Unreachable
    from lowcomm.elastic.runner import Runner
    from lowcomm.transport import ByteMeter

    pair = _view(_d(0, "sync@50", gen=1), _d(3, "sync@50", gen=1))
    member = _Split([pair])
    member.commits[1] = _view(*(_d(s, "sync@50", "commit", gen=1) for s in (0, 3)))
    runner = Runner(member, ByteMeter(), ByteMeter())
    assert runner.rounds is None  # lock-step
    tries = []

    def attempt(view, tag, collectives):
        tries.append(view.members)
        if len(tries) == 1:
            raise Unreachable("could not reach the group's store", ranks=[0])
        return "stood"  # the link is back

    runner._collectives = attempt
    assert runner.run("sync@50", lambda t, b: None) == "stood"
    assert member.splits == [None, None] and tries == [[0, 3], [0, 3]]
    assert member.asked == 4  # sync, commit, sync (not asked again), commit


def test_a_quorum_holding_votes_on_the_same_sync_is_asked_again_not_run_by_half():
    """Chaos seed 85 (quorum rounds, a site added, the lighthouse restarted): sites [0, 1] and
    [3, 4] fell out of step at sync@50; each pair's sync quorum held the other's commit votes,
    which a member leaves out (it runs without them), and each pair's vote then held the other's
    requests, so no vote stood: the pairs took turns for ever. A quorum holding votes on the
    sync asked for is asked again; the voters ask for the next attempt a moment later."""
    from lowcomm.elastic.decide import asking

    votes = [_d(s, "sync@50", "commit", gen=3) for s in (3, 4)]
    half = asking(_view(_d(0, "sync@50", gen=3), _d(1, "sync@50", gen=3), *votes), "sync@50")
    assert half.members == [0, 1] and half.voting == [3, 4]
    stale = asking(_view(_d(0, "sync@50"), _d(3, "sync@40", "commit")), "sync@50")
    assert stale.voting == []  # a vote on another sync is no member of this one to wait for
    everyone = _view(*(_d(s, "sync@50", gen=4) for s in (0, 1, 3, 4)))
    answers = [half, everyone]

    class Scripted(_Checker):
        def _member_view(self, tag, ok, phase, ready):
            return answers.pop(0)

    member = Scripted(0)
    member.elastic = Elastic(lighthouse="http://unused", site=0, sites=5, min_workers=2,
                             heartbeat_s=0.01)  # fmt: skip
    assert member.quorum("sync@50").members == [0, 1, 3, 4]
    assert answers == []


def test_a_quorum_of_at_most_half_the_live_expected_sites_is_asked_again_then_stops():
    """Chaos seeds 102 and 113: torchft's lighthouse forms a quorum at once when every member
    of its previous quorum asks, however few of the live sites they are, so two groups of one
    sync both went on. A sync quorum that is no more than half of its members and the expected
    sites missing from it whose stores answer is asked again (two halves meet), and past
    timeout_s its site stops instead of going on with a model of its own. Sites whose stores
    do not answer (gone, or stopped: a listener nobody reads) are not counted; a quorum of more
    than half goes on at once."""
    import socket

    live = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in "ab"]
    stopped = socket.socket()  # a stopped process's store: the kernel takes, nobody answers
    stopped.bind(("127.0.0.1", 0))
    stopped.listen(8)
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    gone_at = f"127.0.0.1:{gone.getsockname()[1]}"
    gone.close()
    at = {3: f"127.0.0.1:{live[0].port}", 4: f"127.0.0.1:{live[1].port}"}
    at_stopped = f"127.0.0.1:{stopped.getsockname()[1]}"
    half = _view(_d(0, "sync@40"), _d(1, "sync@40"))
    whole = _view(*(_d(s, "sync@40") for s in (0, 1, 3, 4)))

    def member(answers, expected, timeout_s=5.0):
        class Scripted(_Checker):
            def _member_view(self, tag, ok, phase, ready):
                return answers.pop(0) if len(answers) > 1 else answers[0]

        m = Scripted(0)
        m.elastic = Elastic(lighthouse="http://unused", site=0, sites=4, min_workers=2,
                            heartbeat_s=0.01, timeout_s=timeout_s)  # fmt: skip
        m.last_stores = {0: "here", 1: "127.0.0.1:1", **expected}
        return m

    try:
        answers = [half, half, whole]  # the other half asks a moment later: they meet
        assert member(answers, at).quorum("sync@40").members == [0, 1, 3, 4]
        assert answers == [whole]
        with pytest.raises(MembershipError, match=r"its quorum \[0, 1\] was no more than half"):
            member([half], at, timeout_s=0.3).quorum("sync@40")
        # the missing sites gone, or stopped: two is the quorum
        assert member([half], {3: gone_at, 4: at_stopped}).quorum("sync@40").members == [0, 1]
        three = _view(*(_d(s, "sync@40") for s in (0, 1, 3)))
        assert member([three], at).quorum("sync@40").members == [0, 1, 3]  # more than half
        quorum_rounds = member([half], at)
        quorum_rounds.reached = lambda site, tag: False  # not arrived: late, rightly left out
        assert quorum_rounds.quorum("sync@40").members == [0, 1]
    finally:
        stopped.close()


def test_a_joiner_takes_part_in_the_sync_that_admitted_it_without_waiting_for_arrivals():
    """Chaos seed 85: a site added at sync@35 under quorum rounds healed there, then went to
    that sync's arrival wait; the members had told their arrivals to each other's stores
    before it was known, so it waited timeout_s while the members waited for it inside the
    sync, and the heal's attempt failed. The quorum that admitted it is its arrival."""
    from lowcomm.elastic import rounds as rounds_mod

    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    elastic = Elastic(lighthouse="http://unused", site=4, sites=5, rounds="quorum")
    membership = SimpleNamespace(elastic=elastic, store=own, admission=_OPEN, incarnation="a1")
    rounds = rounds_mod.Rounds(membership)

    def waited(step):
        raise AssertionError(f"waited for the others' arrivals at sync@{step}")

    rounds._wait = waited
    rounds.admitted(35)
    assert rounds.arrive(35)
    with pytest.raises(AssertionError, match="sync@40"):
        rounds.arrive(40)  # its next sync is like any other's


def test_a_site_asking_back_in_reads_a_quorum_mid_vote_as_the_members_do():
    """Chaos seed 85 again, once the pairs asked alike: site 2, back from a missed sync, read a
    quorum holding two members' commit votes as its admission and healed, while the members
    asked that quorum again (it was mid-vote); it waited connect_s at a group nobody else
    formed, at every sync. A joiner admits itself only where the members run the quorum."""
    from lowcomm.elastic.decide import admits, asking

    joiner = {"site": 2, "tag": "join", "phase": "join", "gen": 0, "join": True, "fp": "a",
              "join_from": 0, "join_at": "sync@55", "ok": True}  # fmt: skip

    def member(site, phase="sync"):
        return _d(site, "sync@55", phase, fp="a", ready=True, gen=1)

    mid_vote = _view(member(0, "commit"), member(1), joiner, member(3, "commit"), member(4))
    read, _ = admitted_at(asking(mid_vote, run_tag(mid_vote)), "a")
    assert read.joiners == [2] and read.voting == [0, 3]
    assert not admits(read, 2, min_workers=2)
    whole = _view(member(0), member(1), joiner, member(3), member(4))
    read, ref = admitted_at(asking(whole, run_tag(whole)), "a")
    assert admits(read, 2, min_workers=2) and ref.tag == "sync@55"
    theirs = _Checker(0).check(admit(whole, "a", "sync@55", "sync"), "sync@55")
    assert theirs.members == read.members == [0, 1, 2, 3, 4]


def test_after_a_failed_attempt_a_live_member_still_failing_it_is_waited_for():
    """Chaos seed 140 (quorum rounds, site 0 killed inside sync@30): sites 1 and 3 failed at
    once (their peer's connection reset), site 2 only at the deadline (still waiting inside
    the collective); 1 and 3 asked for the next attempt, the lighthouse's half-second window
    closed on [1, 3], and site 2, healthy, found the run gone on and stopped. Under quorum
    rounds the next attempt waits, up to the failed one's deadline, for a member of it whose
    store still answers; a dead one's (site 0) refuses, and is not waited for."""
    from lowcomm.elastic.membership import Patience, Retry

    alive = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gone = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dead = f"127.0.0.1:{gone.port}"
    del gone  # its port now refuses, as a killed site's does
    elastic = Elastic(lighthouse="http://unused", site=1, sites=4, min_workers=2)
    stores = {0: dead, 1: "own", 2: f"127.0.0.1:{alive.port}", 3: "theirs"}
    patience = Patience(elastic, {}, Retry(stores, split=False, wait_s=5.0))
    two = _view(_d(1, "sync@30", gen=1), _d(3, "sync@30", gen=1))
    assert patience.more(two)  # site 2 is alive: ask again
    assert not patience.more(_view(*(_d(s, "sync@30", gen=1) for s in (1, 2, 3))))
    without_2 = Patience(elastic, {}, Retry({0: dead, 1: "own", 3: "theirs"}, wait_s=5.0))
    assert not without_2.more(two)  # the only one missing is dead: run it now
    patience = Patience(elastic, {}, Retry(stores, wait_s=0.0))
    assert not patience.more(two)  # waited the failed attempt's deadline already


def test_a_site_asking_back_in_runs_the_attempt_the_members_run():
    """Chaos seed 85 at `f9e3cfe`: site 2, back from a missed sync, took its attempt number
    from the first member's request (1) while the members ran the highest any of them
    reported (2, seed 32's rule): it waited at group g1, they at g2, and it was excluded as
    unreachable. A joiner reads the attempt as the members do."""
    joiner = {"site": 2, "tag": "join", "phase": "join", "gen": 0, "join": True, "fp": "a",
              "join_from": 0, "join_at": "sync@55", "ok": True}  # fmt: skip
    members = [_d(s, "sync@55", fp="a", ready=True, gen=g) for s, g in ((0, 1), (1, 2), (3, 2))]
    view = _view(members[0], members[1], joiner, members[2])

    site = _Checker(2)
    site.joiner.ask = lambda: view  # type: ignore[method-assign]  # the lighthouse's answer
    site.fingerprint, site.asking_back_at, site.generation = "a", "", 0
    admitted = site.rejoin("sync@55")
    assert admitted is not None and admitted.joiners == [2]
    assert site.generation == 2


def test_a_request_is_read_off_the_wire_once_with_every_field_checked():
    """Request.from_wire: the required fields of their types (a bool is no number), the site
    the participant came in as; optional fields read leniently, as the decisions always did: a
    blame that is no site number blames nobody, unreached sites that are none are dropped."""
    wire = {"site": 2, "tag": "sync@10", "phase": "commit", "gen": 1, "join_from": 0,
            "ok": True, "blame": 3, "why": "bad scale", "unreached": [1, "x", True, 4],
            "inc": "p", "lh": 5, "ranks": 2, "mac": "ab", "run": "r1",
            "name": "r1/site0002"}  # fmt: skip
    r = Request.from_wire(wire, "r1/site0002")
    assert r is not None and (r.site, r.tag, r.phase, r.gen, r.ok) == (
        2,
        "sync@10",
        "commit",
        1,
        True,
    )
    assert (r.blame, r.why, r.unreached, r.inc, r.lh, r.ranks) == (
        3,
        "bad scale",
        (1, 4),
        "p",
        5,
        2,
    )
    assert r.sealed and r.mac == "ab" and "mac" not in r.signed and r.signed["blame"] == 3
    assert Request.from_wire(wire, "r1/site0003") is None  # came in under another site's name
    assert Request.from_wire(wire, "r2/site0002") is None  # ... or another run's
    assert Request.from_wire(wire, "site0002") is None
    # the name it was sealed with is the one it came in under: a copy under another is nobody's
    assert Request.from_wire(wire, "r1/site0002/x") is None
    assert Request.from_wire({**wire, "name": "r1/site0002/x"}, "r1/site0002/x") is not None
    assert Request.from_wire({**wire, "gen": True}) is None
    assert Request.from_wire({**wire, "join_at": 7}) is None
    lenient = Request.from_wire({**wire, "blame": True, "ok": 1, "fp": 3, "lh": "9"})
    assert lenient is not None and lenient.blame is None and lenient.ok is False
    assert lenient.fp is None and lenient.lh == 0


def test_a_sites_pace_reaches_a_new_members_store():
    """Quorum rounds tell each site's step time to the others' stores; a site that appears
    (a restart, a joiner) has a store nobody has written to yet. The others post their pace
    again for it, and it must reach that new store (it went only to the stores known before,
    so the newcomer read the others' pace as absent and waited timeout_s at its syncs)."""
    from lowcomm.elastic import rounds as rounds_mod

    own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    new = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    elastic = Elastic(lighthouse="http://unused", site=0, sites=2, rounds="quorum")
    membership = SimpleNamespace(elastic=elastic, store=own, admission=_OPEN, incarnation="a1")
    rounds = rounds_mod.Rounds(membership)
    rounds._told = 0.25  # this site has told its pace before
    rounds._incs = {0: "a1"}
    view = _view(_d(0, "sync@40", inc="a1", store="own"),
                 _d(1, "sync@40", inc="b1", store=f"127.0.0.1:{new.port}"))  # fmt: skip
    rounds.expect(view, "sync@40")
    key = rounds_mod._key(0, "pace0")
    new.wait([key], timedelta(seconds=30))
    assert new.get(key).decode().startswith("0.250000#0.")  # (its writer: site 0)
