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
from ..protocols import CommitVote, SyncHooks
from ..transport import ByteMeter, Transport, TransportFactory
from . import heal
from .attempts import LockStep, Outcome, Verdict, policy_for
from .decide import View, attempt_of, blamed, committed, complete, dissenters, step_of
from .groups import Unreachable
from .membership import Membership, Retry
from .record import Record
from .rounds import Rounds

log = logging.getLogger("lowcomm")
T = TypeVar("T")

Collectives = Callable[[Transport, Transport], T]  # (training transport, buffer transport)
_SLACK = 4.0  # a group's collectives may take this many times the slowest attempt that stood


class Runner:
    """Runs a sync's collectives on the live quorum; records who was in each sync."""

    def __init__(
        self,
        membership: Membership,
        meter: ByteMeter,
        buffer_meter: ByteMeter,
        transports: TransportFactory = Transport,
        hooks: SyncHooks | None = None,
    ) -> None:
        self.membership, self.hooks = membership, hooks or SyncHooks()
        self.meter, self.buffer_meter, self.transports = meter, buffer_meter, transports
        # who was in each sync, and each change of members
        self.record = Record(membership.elastic.site, say=membership.position == 0)
        self.settled: tuple[str, View] | None = None  # the last sync that stood, its view
        self.current: View | None = None  # the view of the attempt running now
        self._transports: tuple[tuple[int, int, int, str], Transport, Transport] | None = None
        self._started = 0.0
        # the engine's shared state at a sync a joiner may enter, by tag (see ``offer``)
        self._offers: dict[str, Callable[[], dict]] = {}
        self.admitted: View | None = None  # a joiner's first sync: the view that admitted it
        self._slowest = 0.0  # seconds of the slowest attempt that stood (0: none yet)
        self._full = True  # the next group waits the whole timeout_s (first, or after a failure)
        self._collective_s = 0.0  # seconds of the last attempt's collectives
        # rounds=quorum: syncs close on a quorum plus a grace window (see .rounds)
        self.rounds = Rounds(membership) if membership.elastic.rounds == "quorum" else None
        if self.rounds is not None:  # a sync expects only the sites that reached it
            membership.reached = self.rounds.reached
        self._policy = policy_for(membership.elastic.rounds)  # how a failed attempt is retried

    def run(self, tag: str, collectives: Collectives[T]) -> T:
        """Run ``collectives`` for the sync named ``tag`` until a quorum commits it: attempts,
        each settled by a vote, retried as the run's policy says."""
        self._started = time.perf_counter()
        if self.record.last_tag == self.membership.elastic.leave_after:
            self._leave(tag)
        policy, retry = self._policy(), None
        while True:
            outcome = self.attempt(tag, collectives, policy, retry)
            verdict = self.vote(tag, outcome)
            if verdict.stands:
                self._stood(tag, outcome)
                return outcome.result  # type: ignore[no-any-return]
            # a site whose payload most members refused, that most members could not reach,
            # or whose lone vote failed attempt after attempt, leaves every next attempt (all
            # read it from the same votes); it stops itself at its next check
            verdict = policy.judged(outcome, verdict)
            self.membership.exclude(verdict.out, tag, outcome.view)
            retry = policy.after(outcome, verdict)
            self._failed()
            if policy.exhausted():  # (where its collectives failed, hopeless() raises first)
                raise MembershipError(
                    f"site {self._site}: {tag} failed: {policy.exhausted()}; it stops here"
                )

    def attempt(
        self, tag: str, collectives: Collectives[T], policy: LockStep, retry: Retry | None
    ) -> Outcome:
        """Ask who is in, and run ``collectives`` on that quorum's group: what came of it. An
        error taken as real (``policy``: the same members failing again) is raised."""
        ready = tag in self._offers
        asked = self.admitted or self.membership.quorum(tag, ready=ready, retry=retry)
        self.admitted = None
        view = self.membership.check(asked, tag)
        # every member of the quorum on one attempt's group (see attempt_of)
        self.membership.generation = max(self.membership.generation, attempt_of(view))
        t0, deadline = time.perf_counter(), self.deadline(view)
        try:  # the group too: its store's host or a peer may be gone already
            return Outcome(view, self._collectives(view, tag, collectives), deadline_s=deadline)
        # a peer died or hung inside a collective (torch's collective logger turns the error of
        # a group outside its world map into a ValueError); or a peer's payload failed to
        # decode, which its same bytes would do on every try: blamed, not retried; or members
        # never reached the group: named in the vote (see _unreached)
        except (RuntimeError, ValueError) as err:
            unreached = None
            if isinstance(err, Unreachable):
                unreached = [view.members[r] for r in err.ranks if r < len(view.members)]
            if policy.hopeless(view):
                raise  # the same members failed again and again, nobody excluded: stop
            why = _why(err)
            log.warning("site %d: %s failed among %s after %.1f s (deadline %g s: %s); "
                        "retrying", self._site, tag, view.members, time.perf_counter() - t0,
                        deadline, why)  # fmt: skip
            blame = _accused(view, err)
            return Outcome(view, error=why, blame=blame, unreached=unreached, deadline_s=deadline)

    def vote(self, tag: str, outcome: Outcome) -> Verdict:
        """The commit vote on ``outcome``'s attempt, as every member reads it."""
        if not outcome.ok:  # before the vote: peers blocked on this site fail now, not at timeout
            self._drop()
        # vote hooks may change what this site says (a lie must not lead the others astray)
        mine = CommitVote(tag, outcome.ok, outcome.blame, tuple(outcome.view.members))
        said = self.hooks.vote(mine)
        ok, blame = said.ok, said.blame
        commit = self.membership.quorum(
            tag, ok, phase="commit", ready=tag in self._offers, blame=blame,
            unreached=outcome.unreached,
        )  # fmt: skip
        commit = self.membership.check(commit, tag, vote=True)
        generation = self.membership.generation
        if committed(outcome.view, commit, generation, ok):
            return Verdict(True, commit, {})
        lone = tuple(dissenters(outcome.view, commit, generation))
        out = blamed(outcome.view, commit, generation)
        return Verdict(False, commit, out, lone, complete(outcome.view, commit, generation))

    def _stood(self, tag: str, outcome: Outcome) -> None:
        """The sync stood: the deadline learns from its collectives alone; record it."""
        self._slowest, self._full = max(self._slowest, self._collective_s), False
        self._settled(tag, outcome.view)
        self._offers.pop(tag, None)

    def _failed(self) -> None:
        """Every member of the commit saw it fail: all start the next attempt on fresh groups
        (the lighthouse keeps the quorum id when the members did not change), the next one with
        the whole timeout_s (a sync slower than any before fails once, not twice)."""
        self.record.failed_at = self.record.failed_at or time.perf_counter()
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

    def _collectives(self, view: View, tag: str, collectives: Collectives[T]) -> T:
        """``collectives`` on ``view``'s group (no reference to it outlives a failure: see
        _drop)."""
        transports = self._on(view)
        self.current = view  # whose contributions this attempt's collectives carry
        # the bound for this attempt's collectives (a group lives on while its members do)
        self.membership.group(view, self.membership.generation).set_timeout(
            timedelta(seconds=self.deadline(view))
        )
        self._heal_joiners(view, transports[0], tag)
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
        self.record.load(got)
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
        record = self.record.to_wire()
        joiners = [view.rank_of(s) for s in view.joiners]
        seal = self._heal_seal(view, tag)
        _, _, size, sources = heal.hand_over(transport, joiners, view.healer, state, record, seal)
        if not heal.agree(transport, state):
            raise RuntimeError(heal.mismatch(tag))  # this attempt fails; retried without it
        self.record.heal = (time.perf_counter() - t0, size, sources)

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
                self.transports(group, self.meter),
                self.transports(group, self.buffer_meter),
            )
        return self._transports[1], self._transports[2]

    def _settled(self, tag: str, view: View) -> None:
        """Sync ``tag`` stood on ``view``: into the record, and the rounds' expectations."""
        self.record.settle(tag, view, self.membership.excluded, self._started)
        if self.rounds is not None:
            self.rounds.expect(view, tag)
            self.rounds.back()
        self.settled = (tag, view)

    @property
    def members(self) -> list[int] | None:
        """Who took part in the last sync that stood (None before the first)."""
        return self.record.members

    @property
    def events(self) -> list[dict]:
        """The run's membership changes (see :class:`.record.Record`)."""
        return self.record.events

    def ended(self) -> None:
        """This site finished the run: say so at the lighthouse (see :meth:`.Membership.ended`)."""
        self.membership.ended(self.record.last_tag or "start")

    def _leave(self, tag: str) -> None:
        """Replay: this site left here in the recorded run; it leaves the same way, at once
        (its heartbeat stops, so the others go on without it from the next sync), by raising
        SiteLeft, which the site's trainer ends its process on."""
        if self.membership.position == 0:  # a site of several ranks says it once
            print(f"lowcomm: replay: site {self._site} leaves before {tag}, after "
                  f"{self.record.last_tag}, as in the recorded run", flush=True)  # fmt: skip
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
