"""What every member decides alike from one quorum's data: which sync the run is at, who takes
part in it, whom a joiner's request admits, whether an attempt's commit vote stands, and whom
the vote excludes. Pure functions of the lighthouse's views (no lighthouse, no store), so every
member computes the same from the same view (tests/test_protocol.py builds views by hand)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .messages import Request

log = logging.getLogger("lowcomm")


@dataclass
class View:
    """One quorum as this site sees it: its members in rank order and what each reported."""

    quorum_id: int
    members: list[int]  # site numbers, rank order
    data: list[Request] = field(default_factory=list)
    joiners: list[int] = field(default_factory=list)  # members admitted here, to be healed
    # sites whose request was a commit vote on the sync asked for, left out (see asking)
    voting: list[int] = field(default_factory=list)

    @property
    def who(self) -> str:
        """The members as processes (site and incarnation): a site started again after it
        left is another member, though the lighthouse knows it by the same name."""
        return "-".join(f"{d.site}.{d.inc}" for d in self.data)

    @property
    def healer(self) -> int:
        """The rank that hands a joiner the run's membership record (and the whole state where
        the members' bytes differ): the lowest site already in the run."""
        return self.rank_of(next(s for s in self.members if s not in self.joiners))

    @property
    def epoch(self) -> int:
        """The lighthouse's epoch for this quorum's groups: the highest any member reported (every
        member computes the same from the same requests)."""
        return max((d.lh for d in self.data), default=0)

    def rank_of(self, site: int) -> int:
        """This quorum's rank of ``site``."""
        return self.members.index(site)


def run_tag(view: View) -> str | None:
    """The sync the run is at, as every member of ``view`` computes it: the tag most of its
    members (joiners aside) report, the newest on a tie (None: no member reports one). A
    member reporting another is elsewhere: it alone stops or asks back in."""
    tags = [d.tag for d in view.data if not d.join]
    if not tags:
        return None
    return max(set(tags), key=lambda t: (tags.count(t), step_of(t), t))


def in_sync(view: View, tag: str) -> View:
    """``view`` without the members at a sync other than ``tag`` (joiners kept)."""
    keep = [d for d in view.data if d.join or d.tag == tag]
    if len(keep) == len(view.data):
        return view
    gone = [d.site for d in view.data if d not in keep]
    log.warning("sites %s are at another sync than %s: left out of it", gone, tag)
    members = [d.site for d in keep]
    return View(
        view.quorum_id, members, keep, [j for j in view.joiners if j in members], view.voting
    )


def committed(view: View, commit: View, generation: int, ok: bool) -> bool:
    """The vote on one attempt: it stands when this site completed it and every member of
    the attempt's ``view`` asked for the commit quorum of the same sync and attempt
    (``generation``) having completed it. A request of another phase or attempt that the
    lighthouse put in the same quorum (a stale one, re-registered) is no vote."""
    votes = [d for d in commit.data if d.phase == "commit" and d.gen == generation and not d.join]
    return (
        ok
        and [d.site for d in votes] == view.members
        and len(commit.members) == len(votes) + len(commit.joiners)
        and all(d.ok for d in votes)
    )


def blamed(view: View, commit: View, generation: int) -> dict[int, str]:
    """The sites every member excludes after a failed attempt: those blamed by a majority of
    the votes that can judge them (every vote but the accused's own: each member decodes every
    payload, so all honest ones refuse a bad one alike; an accusation nobody corroborates
    excludes nobody), and those left out of the largest set of members that all reached each
    other (see :func:`reachable`), read only from a complete vote (every member of the
    attempt's ``view`` but its joiners voted in this attempt), which every member reads alike.
    In a run of two sites one accuser is the majority of its judges. Site -> what was wrong."""
    votes = _complete_vote(view, commit, generation)
    out: dict[int, str] = {}
    for accused in sorted({d.blame for d in votes if d.blame in view.members}):
        accusers = [d for d in votes if d.blame == accused]
        if 2 * len(accusers) > len([d for d in votes if d.site != accused]):
            out[accused] = accusers[0].why
    return {**out, **_unreached(view, votes)}


def dissenters(view: View, commit: View, generation: int) -> list[int]:
    """The members whose vote alone failed a complete vote: those that said the attempt failed,
    or accused a site nobody else did, while a majority of the votes say it completed. Read
    alike by every member; the retry policy excludes one that does it attempt after attempt."""
    votes = _complete_vote(view, commit, generation)
    if 2 * sum(d.ok for d in votes) <= len(votes):
        return []
    out = set()
    for d in votes:
        lone = d.blame is not None and sum(v.blame == d.blame for v in votes) == 1
        if not d.ok or lone:
            out.add(d.site)
    return sorted(out)


def complete(view: View, commit: View, generation: int) -> bool:
    """Whether ``commit`` holds the vote of every member of ``view``'s attempt but its joiners
    (a quorum round can close before a slow member's vote arrives, sooner still with a
    stranger's request waiting at the lighthouse: then the vote decides nothing)."""
    return bool(_complete_vote(view, commit, generation))


def _complete_vote(view: View, commit: View, generation: int) -> list[Request]:
    """The commit votes of ``view``'s attempt ``generation``, when every member of it but its
    joiners voted (else none: an incomplete vote decides nothing)."""
    votes = [d for d in commit.data if d.phase == "commit" and d.gen == generation and not d.join]
    if [d.site for d in votes] != [s for s in view.members if s not in view.joiners]:
        return []
    return votes


UNREACHED = "unreachable"  # how an exclusion for a broken network begins (see _unreached)
_EXACT = 16  # up to this many members the largest reachable set is found by trying every one


def _unreached(view: View, votes: list[Request]) -> dict[int, str]:
    """The members outside :func:`reachable` (only when some member named another: an attempt
    that failed in its collectives names nobody), each with who could not reach it, when those
    that all reach each other are more than half of the attempt's members. Otherwise nobody: of
    two sides of a partition (two sites that cannot reach each other) neither may go on alone,
    or each would (a quorum of rounds may pair a cut site with each healthy one in turn); the
    attempt is retried, on a quorum that holds more members, or stops (docs/reliability.md)."""
    broken: dict[int, set[int]] = {s: set() for s in view.members}
    for d in votes:
        for site in set(d.unreached):
            if site in broken:
                if site != d.site:
                    broken[site].add(d.site)
                    broken[d.site].add(site)
    if not any(broken.values()):
        return {}
    keep = reachable(view.members, broken)
    if 2 * len(keep) <= len(view.members):  # no side holds a majority: no split brain
        return {}
    return {
        s: f"{UNREACHED}: it and {sorted(broken[s])} could not reach each other"
        for s in view.members
        if s not in keep
    }


def reachable(members: list[int], broken: dict[int, set[int]]) -> list[int]:
    """The largest set of ``members`` no two of which failed to reach each other (``broken``:
    site -> the sites it and they could not connect), the one with the lowest sites on a tie:
    a site cut off on the data plane is left out, and of two sites that cannot reach each other
    the lower stays. Exact up to ``_EXACT`` members; beyond, members are dropped most-broken
    first."""
    if len(members) <= _EXACT:
        best: list[int] = []
        for mask in range(1 << len(members)):
            pick = [m for i, m in enumerate(members) if mask >> i & 1]
            if all(not (broken[a] & set(pick)) for a in pick) and (
                len(pick) > len(best) or (len(pick) == len(best) and pick < best)
            ):
                best = pick
        return best
    keep = list(members)
    while any(broken[a] & set(keep) for a in keep):
        keep.remove(max(keep, key=lambda a: (len(broken[a] & set(keep)), a)))
    return keep


def without(view: View, excluded: dict[int, str]) -> View:
    """``view`` without the excluded processes (site -> its incarnation; as members or
    joiners): the site started again is another process, and may come back."""
    keep = [d for d in view.data if excluded.get(d.site, None) != d.inc]
    if len(keep) == len(view.data):
        return view
    members = [d.site for d in keep]
    return View(
        view.quorum_id, members, keep, [j for j in view.joiners if j in members], view.voting
    )


def asking(view: View, tag: str = "") -> View:
    """``view`` without the members whose request in it is a commit vote: the lighthouse may
    put a vote on one attempt into the quorum another site asks for its next attempt, and a
    member settling an attempt takes no part in another (joiners kept). Those voting on sync
    ``tag`` itself are named in ``voting``: they ask for its next attempt a moment later."""
    keep = [d for d in view.data if d.join or d.phase == "sync"]
    if len(keep) == len(view.data):
        return view
    members = [d.site for d in keep]
    voting = [d.site for d in view.data if d not in keep and d.tag == tag]
    return View(view.quorum_id, members, keep, [j for j in view.joiners if j in members], voting)


def ask_again(
    view: View, excluded: dict[int, str], min_workers: int, split: list[int] | None
) -> bool:
    """Whether a sync quorum is asked again rather than run (:meth:`Membership.quorum`):

    - it holds fewer than ``min_workers`` that take part (:func:`taking_part`): a live site
      whose heartbeat lapsed for a moment (a loaded host) is back in the next one;
    - it is exactly the ``split`` members: the last attempt's, which failed with members that
      could not reach each other and no majority to exclude either side; retried alone they
      fail again until the network heals, while a live site asking a moment later (quorum
      rounds gather those asking within half a second) breaks the tie (chaos seeds 15, 71);
    - it holds commit votes on this sync (``voting``): run without them, two halves of the
      members fell out of step, each half's sync quorum holding the other's votes and each
      vote the other's requests, and none stood (chaos seed 85); asked again, all ask alike."""
    too_few = taking_part(view, excluded) < min_workers
    return too_few or bool(split and view.members == split) or bool(view.voting)


def admits(view: View, site: int, min_workers: int) -> bool:
    """Whether ``view``, a joiner's reading of a quorum (:func:`admitted_at`), admits ``site``
    as the members read it: one they ask again (:func:`ask_again`) admits nobody yet."""
    return site in view.joiners and not ask_again(view, {}, min_workers, None)


def attempt_of(view: View) -> int:
    """The attempt (generation) a quorum's members run next: the highest any member of it
    reports. Each member counts its failed votes itself, and one that missed or doubled a
    vote (its commit quorum was not the others') would otherwise name another group than
    theirs, and the members would wait at different groups until they all stopped (chaos seed
    32); every member reads the same number from the same view."""
    return max((d.gen for d in view.data if not d.join), default=0)


def taking_part(view: View, excluded: dict[int, str]) -> int:
    """How many of ``view``'s members take part in the run's sync as
    :meth:`~lowcomm.elastic.membership.Membership.check` counts them: a member at another sync
    (one back from a pause) or an ``excluded`` process does not, so a quorum it fills up is
    asked again rather than found too small there."""
    now = run_tag(view)
    view = without(view, excluded)
    return sum(1 for d in view.data if d.join or d.tag == now)


def admitted_at(view: View, fingerprint: str) -> tuple[View, Request]:
    """A joiner's reading of a quorum: whom it admits at the run's sync (:func:`run_tag`), the
    members elsewhere left out as every member leaves them out (:meth:`Membership.check`),
    and the request of a member at that sync (its tag, phase and attempt)."""
    tag = run_tag(view)
    ref = next(d for d in view.data if not d.join and d.tag == tag)
    return in_sync(admit(view, fingerprint, tag, ref.phase), tag), ref


def admit(view: View, fingerprint: str, tag: str, phase: str) -> View:
    """The members of a quorum that take part in sync ``tag``: the sites already in the run,
    and the joiners it admits there (the run's settings; the first quorum of a sync of the
    outer loop, ``sync@N``, at or after the step they asked to join from, or exactly the sync
    a replay names), where every old member offers the run's state. Every member computes
    the same from the same view."""
    keep = [d for d in view.data if not d.join]
    joiners = []
    # the members at this sync offer; one elsewhere is left out of it (see check)
    offered = all(d.ready for d in keep if d.tag == tag)
    for d in view.data:
        if d.join and d.fp == fingerprint and phase == "sync" and offered:
            if _joins_at(d, tag):
                keep.append(d)
                joiners.append(d.site)
    keep.sort(key=lambda d: d.site)
    return View(view.quorum_id, [d.site for d in keep], keep, joiners, view.voting)


def step_of(tag: str) -> int:
    """The inner step a tag names (``sync@40`` -> 40, ``flags@40`` too; -1 for a tag
    without one, ``start`` or ``control@40#1``'s)."""
    _, _, step = tag.partition("@")
    return int(step) if step.isdigit() else -1


def _joins_at(d: Request, tag: str) -> bool:
    kind, _, step = tag.partition("@")
    if kind != "sync" or not step.isdigit():
        return False
    return tag == d.join_at if d.join_at else int(step) >= d.join_from


def exclusion(site: int, tag: str, why: str) -> str:
    """The one line an excluded site stops with (``why``: what its accusers saw)."""
    if why.startswith(UNREACHED):
        return (
            f"site {site} is excluded from the run at {tag}: {why} (its network to the others "
            f"broke while the lighthouse still heard it); it stops here, the others go on: "
            f"start it again to rejoin"
        )
    if why.startswith(("its vote alone", "its global copy")):  # what all of them saw
        return f"site {site} is excluded from the run at {tag}: {why}; it stops here"
    return (
        f"site {site} is excluded from the run at {tag}: the others refused its payload ({why}); "
        f"it stops here, the others go on"
    )
