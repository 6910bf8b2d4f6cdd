"""One sync's collectives on the quorum of the moment: ask who is in, run them on that quorum's
group, settle by a commit quorum, and retry among the survivors (same encoded bytes) until the
sync stands for every member."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from ..errors import MembershipError, PayloadError, SiteLeft
from ..protocols import NO_FAULTS, FaultHooks
from ..transport import ByteMeter, Transport
from . import heal
from .decide import View, attempt_of, blamed, committed, step_of
from .groups import Unreachable
from .membership import Membership, Retry
from .rounds import Rounds

log = logging.getLogger("lowcomm")
T = TypeVar("T")

Collectives = Callable[[Transport, Transport], T]  # (training transport, buffer transport)
_SAME_FAILURES = 3  # attempts among unchanged members before an error is taken as real
_SLACK = 4.0  # a group's collectives may take this many times the slowest attempt that stood


class Runner:
    """Runs a sync's collectives on the live quorum; records who was in each sync."""

    def __init__(
        self,
        membership: Membership,
        meter: ByteMeter,
        buffer_meter: ByteMeter,
        delay_s: float,
        faults: FaultHooks = NO_FAULTS,
    ) -> None:
        self.membership, self.faults = membership, faults
        self.meter, self.buffer_meter, self.delay_s = meter, buffer_meter, delay_s
        self.members: list[int] | None = None  # who took part in the last sync that stood
        self.events: list[dict] = []  # membership changes: step tag, who left, seconds lost
        self.settled: tuple[str, View] | None = None  # the last sync that stood, its view
        self.current: View | None = None  # the view of the attempt running now
        self._transports: tuple[tuple[int, int, int, str], Transport, Transport] | None = None
        self._failed_at: float | None = None
        self._started = 0.0
        self._last_tag = "start"  # the last sync that stood with this site in it
        self._last_step = 0  # ... and the last inner step such a sync was at
        # the engine's shared state at a sync a joiner may enter, by tag (see ``offer``)
        self._offers: dict[str, Callable[[], dict]] = {}
        self.admitted: View | None = None  # a joiner's first sync: the view that admitted it
        self._slowest = 0.0  # seconds of the slowest attempt that stood (0: none yet)
        self._full = True  # the next group waits the whole timeout_s (first, or after a failure)
        self._collective_s = 0.0  # seconds of the last attempt's collectives
        # the last heal sent: seconds, the state's bytes, how many members sent them
        self._heal: tuple[float, int, int] | None = None
        # rounds=quorum: syncs close on a quorum plus a grace window (see .rounds)
        self.rounds = Rounds(membership) if membership.elastic.rounds == "quorum" else None

    def run(self, tag: str, collectives: Collectives[T]) -> T:
        """Run ``collectives`` for the sync named ``tag`` until a quorum commits it."""
        self._started = time.perf_counter()
        if self._last_tag == self.membership.elastic.leave_after:
            self._leave(tag)
        stuck: list[list[int]] = []  # the members of each failed attempt that excluded nobody
        retry: Retry | None = None  # quorum rounds: the failed attempt the next one follows
        while True:
            ready = tag in self._offers
            asked = self.admitted or self.membership.quorum(tag, ready=ready, retry=retry)
            self.admitted = None
            view = self.membership.check(asked, tag)
            # every member of the quorum on one attempt's group (see attempt_of)
            self.membership.generation = max(self.membership.generation, attempt_of(view))
            blame, unreached = None, None
            t0 = time.perf_counter()
            try:  # the group too: its store's host or a peer may be gone already
                result, ok = self._attempt(view, tag, collectives), True
            # a peer died or hung inside a collective (torch's collective logger turns the
            # error of a group outside its world map into a ValueError); or a peer's payload
            # failed to decode, which its same bytes would do on every try: blamed, not
            # retried; or members never reached the group: named in the vote (see _unreached)
            except (RuntimeError, ValueError) as err:
                blame = _accused(view, err)
                if isinstance(err, Unreachable):
                    unreached = [view.members[r] for r in err.ranks if r < len(view.members)]
                if stuck[-(_SAME_FAILURES - 1) :].count(view.members) == _SAME_FAILURES - 1:
                    raise  # the same members failed again and again, nobody excluded: stop
                log.warning("site %d: %s failed among %s after %.1f s (deadline %g s: %s); "
                            "retrying", self._site, tag, view.members, time.perf_counter() - t0,
                            self.deadline(view), _why(err))  # fmt: skip
                result, ok = None, False
            if not ok:  # before the vote: peers blocked on this site fail now, not at timeout_s
                self._drop()
            commit = self.membership.quorum(
                tag, ok, phase="commit", ready=ready, blame=blame, unreached=unreached
            )
            commit = self.membership.check(commit, tag, vote=True)
            if committed(view, commit, self.membership.generation, ok):
                # the deadline learns from syncs that stood, their collectives alone
                self._slowest, self._full = max(self._slowest, self._collective_s), False
                self._settled(tag, view)
                self._offers.pop(tag, None)
                return result  # type: ignore[return-value]
            # a site whose payload a member refused, or that most members could not reach,
            # leaves every next attempt (all read it from the same vote); it stops itself at
            # its next check
            out = blamed(view, commit, self.membership.generation)
            self.membership.exclude(out, tag, view)
            if not out:
                stuck.append(view.members)
            # under quorum rounds, whose lighthouse gathers only those asking within half a
            # second, the next attempt waits for the failed one's live members (see Patience)
            # and runs no split pair again; lock-step's lighthouse waits for every live site
            # (asked again there, the same members came back, and the member whose re-asking
            # outlasted the others' asked alone and stopped: chaos seed 112)
            retry = None
            if self.rounds is not None:
                named = unreached or any(d.unreached for d in commit.data)
                live = {d.site: d.store for d in view.data}
                live = {s: a for s, a in live.items() if s not in out}
                retry = Retry(live, not out and bool(named), self.deadline(view))
            # every member of the commit saw it fail: all start the next attempt on fresh groups
            # (the lighthouse keeps the quorum id when the members did not change), the next
            # one with the whole timeout_s (a sync slower than any before fails once, not twice)
            self._failed_at = self._failed_at or time.perf_counter()
            self._full = True
            self.membership.generation += 1
            self._drop()

    def offer(self, tag: str, shared: Callable[[], dict]) -> None:
        """The engine, before it starts sync ``tag``: ``shared()`` gives the run's shared state
        for a joiner admitted there (a site is admitted only where every member offers it)."""
        self._offers[tag] = shared

    def joiner_expected(self, tag: str) -> bool:
        """Whether a site may join at sync ``tag``: one is asking, a replay says so, or a
        site that missed a sync has reached this one (quorum rounds)."""
        if self.membership.joiner_waiting or tag in self.membership.elastic.heal_at:
            return True
        step = step_of(tag)
        return self.rounds is not None and step >= 0 and self.rounds.stale_arrived(step)

    def rejoin(self, tag: str, load: Callable[[dict], dict]) -> bool:
        """A site that missed a sync (quorum rounds) asks back in at sync ``tag`` and heals
        there as a joiner does (``load`` as in :meth:`heal_in`); False when the others were
        already past ``tag`` (it missed this one too)."""
        while True:
            view = self.membership.rejoin(tag)
            if view is None:
                return False
            try:
                self.heal_in(view, tag, load)
                return True
            except MembershipError:
                raise  # not bit-exact, or this site is out: asking again is no cure
            except (RuntimeError, ValueError) as err:  # a member went mid-way: ask again
                log.warning("site %d: the heal at %s failed (%s); asking back in again",
                            self._site, tag, str(err).splitlines()[0][:160])  # fmt: skip
                self._drop()
                self.admitted = None

    def _attempt(self, view: View, tag: str, collectives: Collectives[T]) -> T:
        """One attempt on ``view``'s group (no reference to it outlives a failure: see _drop)."""
        transports = self._on(view)
        self.current = view  # whose contributions this attempt's collectives carry
        # the bound for this attempt's collectives (a group lives on while its members do)
        self.membership.group(view, self.membership.generation).set_timeout(
            timedelta(seconds=self.deadline(view))
        )
        self._heal_joiners(view, transports[0], tag)
        if tag.startswith("sync@"):  # a sync of the outer loop: a collective: fault dies in it
            self.faults.at("collective")  # (and a stall: one stops there)
        t0 = time.perf_counter()
        result = collectives(*transports)
        self._collective_s = time.perf_counter() - t0
        return result

    def heal_in(self, view: View, tag: str, load: Callable[[dict], dict]) -> None:
        """A joiner, on the view that admitted it: receive the run's shared state and its
        record of members, ``load`` it (returns what the engine then holds), compare digests
        with every member; its first ``run`` is then sync ``tag`` on this same view. A site of
        several ranks heals each rank's shard on its own group, and is in only when every
        shard's digest agreed (its ranks raise alike)."""
        failed: BaseException | None = None
        try:
            got, fine = self._heal_shard(view, tag, load)
        except (RuntimeError, ValueError) as err:  # the healer or a member went mid-way
            got, fine, failed = None, False, err
        worst = 0 if fine else 1 if failed is not None else 2
        site = self.membership.site
        worst = site.worst(worst) if site is not None else worst
        if worst == 2:
            raise MembershipError(heal.mismatch(tag))
        if worst == 1:
            raise failed or RuntimeError("the heal of another rank of this site failed")
        assert got is not None
        self.events, self.members = list(got["events"]), list(got["members"])
        self._last_tag, self._last_step = got["last"]
        self.admitted = view
        if self.rounds is not None:
            self.rounds.admitted(step_of(tag))

    def _heal_shard(self, view: View, tag: str, load: Callable[[dict], dict]) -> tuple[dict, bool]:
        """This rank's part of :meth:`heal_in`: the record, and whether the digests agree."""
        transport = self._on(view)[0]
        joiners = [view.rank_of(s) for s in view.joiners]
        seal = self._heal_seal(view, tag)
        state, got, _, _ = heal.hand_over(transport, joiners, view.healer, None, seal=seal)
        loaded = load(state)
        return got, heal.agree(transport, loaded)

    def join_again(self) -> tuple[View, str]:
        """A joiner whose heal failed (its healer died mid-hand-over): this attempt's group
        dropped, ask to join again; the view and sync that admit it next."""
        self._drop()
        self.admitted = None
        return self.membership.join()

    def _heal_joiners(self, view: View, transport: Transport, tag: str) -> None:
        """Sites admitted at this sync get the run's shared state from the old members, striped
        (a joiner itself has already loaded it: see LowComm's start)."""
        if not view.joiners or self._site in view.joiners:
            return
        t0 = time.perf_counter()
        state = self._offers[tag]()  # admitted only where every member offered it
        record = {"events": self.events, "members": self.members,
                  "last": [self._last_tag, self._last_step]}  # fmt: skip
        joiners = [view.rank_of(s) for s in view.joiners]
        seal = self._heal_seal(view, tag)
        _, _, size, sources = heal.hand_over(
            transport, joiners, view.healer, state, record, seal, self.faults.at
        )
        if not heal.agree(transport, state):
            raise RuntimeError(heal.mismatch(tag))  # this attempt fails; retried without it
        self._heal = (time.perf_counter() - t0, size, sources)

    def _heal_seal(self, view: View, tag: str) -> Callable[[bytes], bytes]:
        """The MAC of a heal's digests at ``tag``, bound to the attempt and the healer."""
        admission, gen = self.membership.admission, self.membership.generation
        healer = view.members[view.healer]
        return lambda digests: bytes.fromhex(admission.mac("heal", tag, gen, healer,
                                                           digests.hex()))  # fmt: skip

    def _drop(self) -> None:
        """Close this attempt's group: its connections close with it, so a peer still waiting
        on this site inside a collective fails at once (gloo's abort leaves them open)."""
        if self._transports is not None:
            self.membership.drop(self._transports[0])
            self._transports = None
            gc.collect()  # the failed collective's traceback may still hold the group

    @property
    def _site(self) -> int:
        return self.membership.elastic.site

    def deadline(self, view: View) -> float:
        """The bound on a collective of ``view``'s group: ``_SLACK`` times the slowest
        attempt that stood, at least ``connect_s`` and at most ``timeout_s`` (a peer that hangs
        inside a sync then costs seconds, not ``timeout_s``). The whole ``timeout_s`` for the
        first sync, a heal, and the attempt after a failure, so a sync slower than any before
        it (a slower link) fails once, never twice."""
        e = self.membership.elastic
        if self._full or view.joiners:
            return e.timeout_s
        return min(e.timeout_s, max(e.connect_s, _SLACK * self._slowest))

    def _on(self, view: View) -> tuple[Transport, Transport]:
        """This quorum's transports (made once per quorum), metered with the run's meters."""
        key = self.membership.key(view, self.membership.generation)  # the epoch's too
        if self._transports is None or self._transports[0] != key:
            group = self.membership.group(view, self.membership.generation)
            self._transports = (
                key,
                Transport(group, meter=self.meter, delay_s=self.delay_s),
                Transport(group, meter=self.buffer_meter),
            )
        return self._transports[1], self._transports[2]

    def _settled(self, tag: str, view: View) -> None:
        """Record a change of members: who left (and how long the survivors took to sync
        again), who joined (and what their heal cost)."""
        if self.members is not None and view.members != self.members:
            gone = sorted(set(self.members) - set(view.members))
            # from the first failure (or, for a site lost between syncs, from asking for this
            # sync's quorum) until the survivors' sync stood
            lost = time.perf_counter() - (self._failed_at or self._started)
            event = {"at": tag, "after": self._last_tag, "last_step": self._last_step}
            event["left"] = gone
            excluded = [s for s in gone if s in self.membership.excluded]
            if excluded:  # refused for its payload, not lost: said as such in the record
                event["excluded"] = excluded
            event.update(members=list(view.members), resync_s=round(lost, 3))
            if view.joiners:
                event["joined"] = list(view.joiners)
                if self._heal is not None:  # measured by the old members that sent it
                    seconds, size, sources = self._heal
                    event.update(heal_s=round(seconds, 3), heal_bytes=size, heal_from=sources)
            self.events.append(event)
            said = self.membership.position == 0  # a site of several ranks says it once
            if gone and said:
                log.warning("site %d: sites %s left at %s; %d sites go on", self._site, gone,
                            tag, len(view.members))  # fmt: skip
            if view.joiners and said:
                log.warning("site %d: sites %s joined at %s; %d sites go on", self._site,
                            view.joiners, tag, len(view.members))  # fmt: skip
        self._heal = None
        if self.rounds is not None:
            self.rounds.expect(view, tag)
            self.rounds.back()
        self.members = list(view.members)
        self.settled = (tag, view)
        self._failed_at = None
        self._last_tag = tag
        _, _, step = tag.partition("@")
        if step.isdigit():  # a sync of the outer loop (others: flags, checks, control)
            self._last_step = int(step)

    def _leave(self, tag: str) -> None:
        """Replay: this site left here in the recorded run; it leaves the same way, at once
        (its heartbeat stops, so the others go on without it from the next sync), by raising
        SiteLeft, which the site's trainer ends its process on."""
        if self.membership.position == 0:  # a site of several ranks says it once
            print(f"lowcomm: replay: site {self._site} leaves before {tag}, after "
                  f"{self._last_tag}, as in the recorded run", flush=True)  # fmt: skip
        self.membership.close()
        raise SiteLeft(tag)


def _why(err: BaseException) -> str:
    """The first line of what failed: torch's collective logger hides a group's own error
    behind a ValueError of its world map (our groups are not in it); that error is its
    context."""
    if "world group map" in str(err) and err.__context__ is not None:
        err = err.__context__
    lines = str(err).splitlines()
    return lines[0][:160] if lines else type(err).__name__


def _accused(view: View, err: BaseException) -> tuple[int, str] | None:
    """(site, what was wrong) when ``err`` is a payload that failed to decode and names its
    sender (a group rank of ``view``); None for any other failure."""
    sender = err.sender if isinstance(err, PayloadError) else None
    if sender is None or not 0 <= sender < len(view.members):
        return None
    return view.members[sender], str(err).splitlines()[0]
