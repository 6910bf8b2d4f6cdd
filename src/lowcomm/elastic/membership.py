"""Who is in the run, decided by torchft's lighthouse, and the data-plane group of each quorum.

The lighthouse (``torchft.coordination.LighthouseServer``, Rust) keeps the members' heartbeats
and forms a quorum from the sites that ask for one: every live member of the last quorum, or,
once a member's heartbeat has lapsed, those still alive. lowcomm asks once per outer sync, not
per inner step. The bytes never go through the lighthouse: each quorum gets a gloo group of its
own, built on the store that its first member hosts, under a prefix naming the run, the
lighthouse's epoch, the quorum and the attempt (``torch.distributed.PrefixStore``), so two groups
never share a connection.

The lighthouse may die and come back (the launcher starts it again at the same address): a
quorum request that cannot reach it is asked again, on a new client, for up to ``timeout_s``;
the sites train on meanwhile (only a sync waits). A restarted lighthouse counts its quorum ids
from the start again, so each site counts the outages it saw (its epoch, in every request) and
a quorum's groups carry the highest epoch of its members: ids of a new lighthouse never meet
an old group's store keys.

Every exchange is settled by a second quorum, the commit: each member reports whether its
collectives completed; the result stands only if every member of the commit quorum completed
the same sync with the same members. Otherwise all of them retry on a new quorum with the same
encoded bytes, so a result is never applied by some survivors and not by others.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

from ..config.membership import MembershipSettings
from ..errors import ConfigError, MembershipError
from .admission import Admission, read_secret
from .decide import (
    View,
    admit,
    ask_again,
    asking,
    attempt_of,
    exclusion,
    in_sync,
    run_tag,
    without,
)
from .groups import (
    arrive,
    gloo_group,
    group_name,
    listening_store,
    store_of,
    unanswered,
    unreachable,
)
from .joining import Joiner
from .link import Link, prove
from .messages import replica_name
from .reading import Reader
from .site import SiteRanks

T = TypeVar("T")

log = logging.getLogger("lowcomm")


@dataclass(frozen=True, kw_only=True)
class Elastic(MembershipSettings):
    """Membership settings: ``LowComm(..., elastic=Elastic(lighthouse=..., site=..., sites=3))``.

    A site is one member of the run (one process, or a site of several ranks); the run goes on
    while at least ``min_workers`` sites remain. Every wait is bounded: a site whose heartbeat
    lapses for the lighthouse's heartbeat timeout is left out, a collective with a dead peer
    fails within ``timeout_s``. Besides where this site is and how it enters the run, it holds
    what every site of the run shares (:class:`~lowcomm.config.membership.MembershipSettings`).
    """

    lighthouse: str  # address of a running LighthouseServer (``http://host:port``)
    site: int  # this site's number, 0-based; unique in the run
    sites: int  # how many sites start the run (the first quorum waits for all of them;
    # a joiner may be a new site, numbered from there on)
    # the run's name: its sites' names at the lighthouse, its stores and its key (with a
    # secret), so two runs on one lighthouse never mix
    run_id: str = "lowcomm"
    heartbeat_s: float = 0.2  # how often this site tells the lighthouse it is alive
    timeout_s: float = 60.0  # bound on one quorum wait and on one collective
    connect_s: float = 10.0  # bound on every member reaching a new quorum's group
    leave_after: str = ""  # replay: leave the run once this sync (a tag) has been settled
    join: bool = False  # this site joins a running run (it heals from a live peer)
    # launched on its own: it starts with the others, or joins the run if it is going (enter)
    enter: bool = False
    back: bool = False  # ... into its folder's unfinished run: it joins a run going, never starts
    join_from: int = 0  # ... admitted at the run's first sync at or after this inner step
    join_at: str = ""  # ... or exactly at this sync (a replay of a recorded join)
    heal_at: tuple[str, ...] = ()  # replay: the syncs where sites joined (offer a heal there)

    def __post_init__(self) -> None:
        if not isinstance(self.lighthouse, str) or not self.lighthouse:
            raise ConfigError("elastic needs lighthouse=ADDRESS of a running torchft lighthouse")
        if "://" not in self.lighthouse:  # HOST:PORT, as `lowcomm lighthouse` prints it
            object.__setattr__(self, "lighthouse", f"http://{self.lighthouse}")
        if not 0 <= self.site < self.sites and not (self.join and self.site >= 0):
            raise ConfigError(
                f"site must be in [0, sites={self.sites}) (or a joiner's new number), "
                f"got {self.site}"
            )
        super().__post_init__()
        self.check_sites(self.sites)

    @property
    def quorum_size(self) -> int:
        """rounds=quorum: how many sites close a sync (``quorum``, or a majority)."""
        return self.quorum or self.sites // 2 + 1

    @property
    def replica_id(self) -> str:
        """This site's name at the lighthouse: its run id and its number."""
        return replica_name(self.run_id, self.site)


class Membership:
    """This site's membership: heartbeats, quorums, the commit vote and each quorum's group
    (the joiner's side: its :class:`.joining.Joiner`)."""

    # a site of one process (set per instance for a site of several ranks: see __init__)
    site: SiteRanks | None = None
    ranks, position, host = 1, 0, ""
    joiner_waiting = False  # a site with this run's settings asked to join, last quorum

    def __init__(
        self, elastic: Elastic, fingerprint: str = "", site: SiteRanks | None = None
    ) -> None:
        self.elastic = elastic
        self.fingerprint = fingerprint  # the run's settings: a site with others is refused
        # a site of several ranks: rank 0 asks the lighthouse for all (see .site)
        self.site = site
        self.ranks = site.size if site is not None else 1
        self.position = site.rank if site is not None else 0  # this rank's place in its site
        self.generation = 0  # the runner's failed commits so far (a joiner adopts the run's)
        self.incarnation = uuid.uuid4().hex[:8]  # this process, among the site's restarts
        self.joiner_waiting = False  # a site with this run's settings asked to join, last quorum
        self.asking_back_at = ""  # a late site asking back in: the sync it asks for (rejoin)
        self.joiner = Joiner(self)  # asks to join through this membership
        # sites excluded from the run (a payload refused, or unreachable), with the line said
        self.excluded: dict[int, str] = {}
        self._excluded_inc: dict[int, str] = {}  # ... the process excluded (a restart is not)
        self._blame: tuple[int, str] | None = None  # this site's accusation in its next vote
        self._unreached: list[int] = []  # sites this site could not reach (its next vote)
        self._groups: dict[tuple[int, int, str], dist.ProcessGroup] = {}
        secret = read_secret(elastic.secret_file)
        self.admission = Admission(elastic.site, elastic.run_id, secret, elastic.sites)
        self.reader = Reader(elastic, fingerprint, self.admission, self.ranks)  # its quorums
        self.last_members: list[int] = []  # the members of the last sync quorum it checked
        self.last_stores: dict[int, str] = {}  # ... and their stores
        # quorum rounds: whether a site reached a sync (its arrival hint: see .rounds)
        self.reached: Callable[[int, str], bool] | None = None
        atexit.register(self.close)  # groups aborted before torch tears itself down
        # the address this site's data plane listens on and advertises (its store, and its
        # gloo connections to the other sites); unset: loopback, gloo's own choice
        self.host = os.environ.get("LOWCOMM_ADDR", "")
        self._store: dist.TCPStore | None = None
        self._link: Link | None = None
        self.store_address = ""
        if site is not None and not site.leads:
            # a site's other ranks: rank 0 hosts the store and talks to the lighthouse; a keyed
            # one's ranks each check the lighthouse's proof, so every rank refuses an open one
            # with the same line (not "another rank of this site is gone")
            if self.admission.keyed:
                prove(elastic, self.admission)
            return
        # this site hosts a store, on its data-plane address alone; the groups of a quorum
        # live on its first member's store
        self._store, self._listening = listening_store(self.host or "127.0.0.1")
        self.store_address = f"{self.host or '127.0.0.1'}:{self._store.port}"
        # heartbeats from now on; quorums wait out an outage
        self._link = Link(
            elastic, self.admission.seal, lambda: self.reader.name, self.admission,
            self.incarnation,
        )  # fmt: skip

    def quorum(
        self, tag: str, ok: bool = True, phase: str = "sync", ready: bool = False,
        blame: tuple[int, str] | None = None, unreached: list[int] | None = None,
        retry: Retry | None = None,
    ) -> View:  # fmt: skip
        """Wait for the next quorum, reporting ``tag`` (which sync), ``phase`` (its collectives
        or their commit), ``ok`` (did this site complete them) and ``ready`` (does it offer a
        heal here: a joiner is admitted only where every member does); raises MembershipError when
        this site is out or too few remain. Sites asking to join are in the view only when
        admitted here (the same settings, at a sync they may join at): see :func:`admit`.

        A sync quorum is asked again while :class:`Patience` says so (too few, mid-vote, and
        for an attempt after a failed one, ``retry``: the same split pair, or a live member of
        the failed attempt still missing). ``blame``: (site, why) when this site's attempt
        failed on that site's payload (a commit vote carries it; see :func:`blamed`);
        ``unreached``: the sites this site could not reach at the attempt's group (its commit
        vote carries them too). A site of several ranks votes ok only if every rank did
        (:meth:`.site.SiteRanks.vote`); its rank 0 asks, and every rank gets the view."""
        unreached = list(unreached or [])
        if self.site is not None and phase == "commit":
            ok, blame, unreached = self.site.vote(ok, blame, unreached)

        def ask() -> tuple[View, bool]:
            return self._quorum(tag, ok, phase, ready, blame, unreached, retry), self.joiner_waiting

        view, self.joiner_waiting = self.lead(ask)
        return view

    def lead(self, fn: Callable[[], T]) -> T:
        """``fn()`` here, or for a site of several ranks on its rank 0, every rank getting
        its result (see :meth:`.site.SiteRanks.lead`)."""
        return fn() if self.site is None else self.site.lead(fn)

    def _quorum(
        self, tag: str, ok: bool, phase: str, ready: bool, blame: tuple[int, str] | None,
        unreached: list[int], retry: Retry | None,
    ) -> View:  # fmt: skip
        """:meth:`quorum` of this process (a site's rank 0)."""
        self._blame, self._unreached = blame, unreached
        view = self._member_view(tag, ok, phase, ready)
        # a commit vote is never asked again: an attempt's vote among fewer sites fails it, and
        # the next attempt's quorum (which may admit a joiner) is the one that must be enough
        patience = Patience(self.elastic, self._excluded_inc, retry, tag in self.elastic.heal_at,
                            names=(self.reader, self.last_members),
                            expected=self._expected(tag))  # fmt: skip
        while phase == "sync" and patience.more(view):
            log.debug("site %d: %s quorum of %s: not yet", self.elastic.site, tag, view.members)
            time.sleep(self.elastic.heartbeat_s)  # the lighthouse answers a lone asker at once
            view = self._member_view(tag, ok, phase, ready)
        if phase == "sync" and self.elastic.site not in view.members:  # its name, still taken
            raise MembershipError(
                f"site {self.elastic.site} was left out of the run at {tag}: it stops here"
            )
        return view

    def _expected(self, tag: str) -> dict[int, str]:
        """Whom sync ``tag`` expects besides this site (site -> store): the last sync's
        members; with quorum rounds, only those that reached it (the rest are late for it,
        and rightly left out)."""
        expected = {s: a for s, a in self.last_stores.items() if s != self.elastic.site}
        if self.reached is not None:
            expected = {s: a for s, a in expected.items() if self.reached(s, tag)}
        return expected

    def _member_view(self, tag: str, ok: bool, phase: str, ready: bool) -> View:
        """One quorum, as the members of the run see it (joiners filtered by :func:`admit`)."""
        view = self.ask(tag, ok, phase, join=False, ready=ready)
        if phase == "sync":  # a vote on another attempt is nobody who asks for this one
            view = asking(view, tag)
        self.joiner_waiting = any(d.join and d.fp == self.fingerprint for d in view.data)
        if self.elastic.site not in view.members and not self.reader.may_wait():
            raise MembershipError(
                f"site {self.elastic.site} was left out of the run at {tag}: it stops here"
            )
        for d in view.data:  # one line, once, for each site with another run's settings
            if d.join and d.fp != self.fingerprint:
                self.reader.refused(d, "site %d asked to join with other settings (%s); refused")
        return admit(view, self.fingerprint, tag, phase)

    def join(self, first: View | None = None) -> tuple[View, str]:
        """A joining site: ask until the run admits it at a sync; that view and the sync's tag.
        Raises MembershipError, before any model state moves, when the run's settings differ
        or no other site has been alive for ``timeout_s``. ``first``: a quorum this site has
        already asked for as a joiner (see :func:`~.enter.enter`), read first: the members may
        have admitted it there, and a view passed over would leave them waiting at its group."""
        view, tag = self.lead(lambda: self.joiner.join(first))
        self.generation = attempt_of(view)  # as every member reads it
        return view, tag

    def rejoin(self, tag: str) -> View | None:
        """A site that missed a sync (rounds=quorum) asks back in at ``tag``: the view that
        admits it there, to heal from; None when the others have already gone past ``tag``
        (it missed this one too)."""
        view = self.lead(lambda: self.joiner.rejoin(tag))
        if view is not None:
            self.generation = attempt_of(view)  # as every member reads it
        return view

    @property
    def store(self) -> dist.TCPStore:
        """This site's own store (it hosts it): quorum groups of which it is first, and the
        hints of quorum rounds (:mod:`.rounds`); a site's rank 0 only."""
        assert self._store is not None, "a site's other ranks host no store"
        return self._store

    def ask(self, tag: str, ok: bool, phase: str, join: bool, ready: bool) -> View:
        e, seq = self.elastic, time.time_ns()  # seq: this request among the site's (see .reading)
        data = {
            "site": e.site, "tag": tag, "ok": ok, "store": self.store_address, "phase": phase,
            "fp": self.fingerprint, "run": e.run_id, "gen": self.generation, "join": join,
            "join_from": e.join_from, "join_at": self.asking_back_at or e.join_at,
            "inc": self.incarnation, "ready": ready, "enter": e.enter, "ranks": self.ranks,
            "name": self.reader.name, "seq": seq,
        }  # fmt: skip
        if self._blame is not None and phase == "commit":
            data.update(blame=self._blame[0], why=self._blame[1][:200])
        if self._unreached and phase == "commit":
            data.update(unreached=self._unreached)
        # a live peer may reach the vote up to timeout_s late (a collective waiting on a lost
        # site) after connect_s at a group, and the lighthouse waits timeout_s for stragglers:
        # a wait of exactly timeout_s would give up on a peer about to arrive
        assert self._link is not None, "only a site's rank 0 asks the lighthouse"
        q = self._link.quorum(tag, data, 2 * e.timeout_s + e.connect_s, self.store_address)
        seq = self._link.sent_seq  # its last send's (a send retried is stamped anew)
        data = self.reader.read(q.participants, join, self.incarnation, seq)
        self._link.adopt([d.lh for d in data])
        return View(int(q.quorum_id), [d.site for d in data], data)

    def start(self) -> View:
        """The first quorum that holds every starting site (an early one may form while a
        site is still starting up: it is asked again)."""
        view = self.quorum("start")
        while len(view.members) < self.elastic.sites:
            view = self.quorum("start")
        self._last(view)  # whom the first sync waits for (see Patience)
        return view

    def _last(self, view: View) -> None:
        """``view`` is the last sync's: its members, and their stores."""
        self.last_members = list(view.members)
        self.last_stores = {d.site: d.store for d in view.data if d.store}

    def check(self, view: View, tag: str, vote: bool = False) -> View:
        """The members of ``view`` that take part in sync ``tag``: a member at another sync
        (paused, or its heartbeat lapsed while the rest went on) is left out of it by every
        member alike. Stops this site, with one line, if it is the one elsewhere (see
        :func:`run_tag`) or excluded, or too few remain (not for a ``vote``: a commit quorum
        of fewer sites fails its attempt, and the next attempt's quorum decides)."""
        e = self.elastic
        if e.site in self.excluded:
            raise MembershipError(self.excluded[e.site])
        view = without(view, self._excluded_inc)
        for site in [s for s in view.members if s in self.excluded]:  # started again: back
            self.excluded.pop(site)
            self._excluded_inc.pop(site)
        current = run_tag(view)
        if current is not None and current != tag:
            raise MembershipError(
                f"site {e.site} is at {tag} while the run is at {current}: this site was left "
                f"out (paused, or its heartbeat lapsed) and stops here; the others go on"
            )
        view = in_sync(view, tag)
        if not vote:
            self._last(view)
        if not vote and len(view.members) < e.min_workers:
            raise MembershipError(
                f"only {len(view.members)} sites remain ({view.members}) after {e.timeout_s:g} "
                f"s, fewer than min_workers={e.min_workers}: the run stops"
                + self.admission.explain()
            )
        return view

    def exclude(self, sites: dict[int, str], tag: str, view: View | None = None) -> None:
        """Exclude ``sites`` (site -> what its accusers saw) from the run from sync ``tag`` on:
        every member does so from the same vote (:func:`blamed`); an excluded site stops at
        its next check, with one line. The process is excluded, as ``view`` names it: the site
        started again (a new process, healed as a joiner) may come back."""
        incs = {d.site: d.inc for d in (view.data if view else [])}
        for site, why in sites.items():
            self._excluded_inc[site] = incs.get(site, "")
            self.excluded[site] = exclusion(site, tag, why)
            log.warning("site %d: site %d excluded at %s: %s", self.elastic.site, site, tag, why)

    def group(self, view: View, generation: int = 0) -> dist.ProcessGroup:
        """The gloo group of ``view``'s members for attempt ``generation`` (made once each).

        Keyed by the member processes too: the lighthouse keeps a quorum id while the same
        site names ask, but a site asking to join is in some syncs' groups and not in others',
        and a site started again is a new process under its old name. Groups of older quorums
        and attempts are aborted (ids and attempts only grow, so a key never returns after its
        group was aborted, and a store prefix is never used twice)."""
        key = self.key(view, generation)
        if key in self._groups:
            return self._groups[key]
        for k in [k for k in self._groups if k[:3] != key[:3]]:  # done with, or broken
            self._groups.pop(k).abort()
        if view.members[0] == self.elastic.site and self._store is not None:
            store = self._store
        else:  # (a site's other ranks use its rank 0's store as the other sites do)
            store = store_of(view, self.elastic.connect_s)
        name = self.admission.bind(group_name(self.elastic.run_id, view, generation))
        if self.ranks > 1:  # each rank syncs its shard with the same rank of the other sites
            name += f"p{self.position}/"
        prefix = dist.PrefixStore(name, store)
        rank, size = view.rank_of(self.elastic.site), len(view.members)
        arrive(prefix, rank, size, self.elastic.connect_s)
        group = gloo_group(prefix, rank, size, self.elastic.timeout_s, self.host)
        self._groups[key] = group
        return group

    @staticmethod
    def key(view: View, generation: int) -> tuple[int, int, int, str]:
        """A group's key: the lighthouse's epoch, the quorum id, the attempt, the members."""
        return (view.epoch, view.quorum_id, generation, view.who)

    def drop(self, key: tuple[int, int, int, str]) -> None:
        """Forget the group of ``key`` (see :meth:`key`): once nothing else holds
        it, gloo closes its connections, and peers blocked on them fail at once."""
        group = self._groups.pop(key, None)
        if group is not None:
            group.abort()

    def ended(self, tag: str) -> None:
        """This site finished the run after sync ``tag``: a keyed site tells its lighthouse's
        front, so that a site still away from the run never takes itself for the run when
        it comes back (see .front). Rank 0 of a site only."""
        if self._link is not None:
            self._link.end(tag)

    def close(self) -> None:
        """Stop the heartbeats (the lighthouse then leaves this site out) and the groups."""
        if self._link is not None:
            self._link.close()
        for group in self._groups.values():
            group.abort()
        self._groups.clear()


@dataclass
class Retry:
    """A sync's attempt after a failed one (quorum rounds, whose lighthouse gathers only those
    asking within half a second): the failed attempt's ``members`` with their stores, whether
    they were a ``split`` (no majority to exclude either side), and ``wait_s``, its deadline."""

    members: dict[int, str]  # site -> its store's address
    split: bool = False
    wait_s: float = 0.0


class Patience:
    """Whether a sync quorum is asked again rather than run, and for how long: what
    :func:`ask_again` says, for ``timeout_s`` from the first such answer (the lighthouse may
    have held the request that long already); and, after a failed attempt, while a member of
    it whose store still answers (alive: a dead site's refuses, a cut one's does not answer)
    is missing, for the failed attempt's deadline: a member that fails a collective later
    than the others (still waiting on a dead peer) asks a moment after they did, and a
    quorum without it would leave it out of the run (chaos seed 140). ``heal``: a replay's
    sync where a site joined in the recorded run: asked again until a joiner is admitted, for
    ``timeout_s`` (its command may be started again a moment later than the others got there).
    ``names``: this site's :class:`.reading.Reader` and the last sync's members: asked again
    while this site's name was taken, or a member's name came with junk and it is missing, for
    ``timeout_s``. ``expected``: the sites this sync expects (site -> store): while the quorum
    is no more than half of its members and the expected sites missing from it whose stores
    answer, asked again for ``timeout_s``, then this site stops (see :meth:`_outnumbered`)."""

    def __init__(
        self, elastic: Elastic, excluded: dict[int, str], retry: Retry | None, heal: bool = False,
        names: tuple[Reader, list[int]] | None = None, expected: dict[int, str] | None = None,
    ) -> None:  # fmt: skip
        self.elastic, self.excluded, self.retry = elastic, excluded, retry
        self.names = names  # this site's reading, and the last sync's members (see .reading)
        self.expected = expected or {}
        self._outnumbered_at: float | None = None
        self._until: float | None = None
        self._named: float | None = None
        self._awaiting: float | None = None
        self._heal: float | None = time.monotonic() + elastic.timeout_s if heal else None

    def more(self, view: View) -> bool:
        """Whether to ask again after ``view``."""
        now, retry = time.monotonic(), self.retry
        if self.names is not None and self.names[0].may_wait():  # this site's name was taken
            return True
        if self._heal is not None and not view.joiners and now < self._heal:
            return True
        split = list(retry.members) if retry is not None and retry.split else None
        if ask_again(view, self.excluded, self.elastic.min_workers, split):
            self._until = self._until or now + self.elastic.timeout_s
            return now < self._until
        if self._outnumbered(view, now):
            return True
        absent = {
            s: a
            for s, a in (retry.members if retry else {}).items()
            if s not in view.members and s not in self.excluded
        }
        if absent and len(unreachable(absent, _PROBE_S)) < len(absent):
            self._awaiting = self._awaiting or now + (retry.wait_s if retry else 0.0)
            return now < self._awaiting
        return self._taken(view, now)

    def _outnumbered(self, view: View, now: float) -> bool:
        """Whether ``view`` is no more than half of the sites this sync expects that are
        alive: its members and the expected sites missing from it whose stores answer.

        Why: torchft's lighthouse forms a quorum at once when every member of its previous
        quorum asks, however few of the live sites they are; after a small quorum (a joiner's,
        a restarted lighthouse's first), two groups asking a moment apart for one sync both
        got one and both went on (chaos seeds 102, 113). Two groups cannot both hold more
        than half of the same sites: asked again, the smaller waits for the rest, and two of
        equal size meet. Past ``timeout_s`` the others are taken to have gone on without this
        site, which stops with one line (going on would be a model of its own)."""
        missing = {
            s: a
            for s, a in self.expected.items()
            if s not in view.members and s not in self.excluded
        }
        if 2 * len(view.members) > len(view.members) + len(missing):
            return False
        silent = unanswered(missing, _PROBE_S)
        live = [s for s in missing if s not in silent]
        if 2 * len(view.members) > len(view.members) + len(live):
            return False
        self._outnumbered_at = self._outnumbered_at or now
        if now - self._outnumbered_at < self.elastic.timeout_s:
            return True
        raise MembershipError(
            f"site {self.elastic.site}: its quorum {view.members} was no more than half of the "
            f"live sites of the last sync ({sorted([*view.members, *live])}) for "
            f"{self.elastic.timeout_s:g} s (timeout_s): the others went on without it (it was "
            f"left out); this site stops here"
        )

    def _taken(self, view: View, now: float) -> bool:
        """This site was displaced from its name, or a member of the last sync is missing and
        its name came with junk (see .reading): asked again, for ``timeout_s``."""
        if self.names is None:
            return False
        reader, last = self.names
        if reader.may_wait():
            return True
        if not (reader.taken & set(last)) - set(view.members) - set(self.excluded):
            return False
        self._named = self._named or now + self.elastic.timeout_s
        return now < self._named


_PROBE_S = 0.5  # a live member's store answers at once, a cut one's never


# what every request a member reads must carry, and its type
