"""Quorum rounds (``rounds=quorum``): a sync closes once ``quorum`` sites have reached it and a
grace window has passed, not when the slowest site has.

Who takes part in a sync is still the lighthouse's quorum; what this module adds are hints on
our own data plane, so that no site waits for the slowest and no site is cut out needlessly:

- a site reaching a sync adds one to that sync's arrival count in every site's store (each
  site hosts one: :attr:`Membership.store`), so everyone reads the count from its own store;
- a site still stepping that sees ``quorum`` arrivals stops at that step boundary, unless all
  its remaining steps fit well inside the grace window, and goes to the sync with the steps it
  took (the merge weights its pseudo-gradient by them: docs/algorithms.md);
- a site that has arrived waits until every expected site has, or ``quorum`` have plus the
  grace window, then marks the sync closed and asks the lighthouse, which settles who is in
  (it waits ``join_timeout`` for the rest of those asking);
- a site that arrives after the sync was marked closed is late: it skips that sync, goes on
  training, and asks back in at its next one, where it heals like a joiner and carries its
  work in (``late=carry``) or starts from the run's model (``late=drop``).

The hints only ever make a site stop early or skip; they never decide membership. Each carries
its writer's site and process (``value#site.inc``), sealed with the rest under a run secret: a
reader that knows the members' processes (from the last quorum) reads a hint of another
process of a member (a recording of an earlier session of the same run id, written again) or
of a non-member as absent. (Before its first quorum a site knows no process and reads every
hint with a valid MAC; and every site posts its pace again when the members' processes
change, so a new member's, read as absent until its process was known, is read then.)
"""

from __future__ import annotations

import collections
import logging
import queue
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .decide import View, step_of
from .membership import Membership

log = logging.getLogger("lowcomm")

# the lighthouse's join_timeout for quorum rounds: sites ask once a sync has closed, so it need
# only gather those asking within a moment of each other (lock-step waits for every live site)
LIGHTHOUSE_JOIN_S = 0.5
_POLL_S = 0.002  # between reads of this site's own store while waiting at a sync
_AUTO_MARGIN_S = 0.05  # auto grace: added to 3x the slowest step (a loaded host's jitter)
# while waiting at a sync, how often to write to the expected sites' stores: a site that exited
# (its store refuses) is no longer waited for (a hung one stalls only its own posting thread)
_PROBE_S = 0.5


class Rounds:
    """This site's side of quorum rounds: arrival hints, the cut-short test and lateness."""

    def __init__(self, membership: Membership) -> None:
        e = membership.elastic
        self.membership = membership
        self.quorum, self.grace_s, self.late = e.quorum_size, e.grace, e.late
        self.stale = False  # missed a sync: its shared state is behind until it heals
        self.late_syncs = 0  # syncs this site missed
        self.cut_rounds = 0  # rounds this site ended early (quorum reached before its H steps)
        self.cut_steps = 0  # inner steps those rounds skipped
        self._stores: dict[int, str] = {}  # expected site -> its store's address
        self._incs: dict[int, str] = {}  # the last quorum's members -> their process
        self._missed: dict[int, int] = {}  # expected site not in the last views -> syncs missed
        self._dead: set[str] = set()  # stores that could not be reached (their site is gone)
        self._seen: dict[int, float] = {}  # send step -> when this site saw the quorum there
        self._admitted = -1  # a joiner: the step of the sync whose quorum admitted it
        self._last_step: float | None = None
        self.step_s = 0.0  # this site's inner step time (the median of the last few)
        self._recent: collections.deque[float] = collections.deque(maxlen=9)
        self._told = 0.0  # the step time last told to the others
        self._own = membership.store
        self._admission = membership.admission  # hints carry a MAC under a run secret
        # one posting thread per peer store: a peer that hangs (SIGSTOP) holds up only the
        # hints to itself (one shared thread once stalled every hint behind it, and every sync
        # then waited timeout_s for arrivals that were never delivered)
        self._posts: dict[str, queue.Queue[tuple[str, str]]] = {}

    # -- what the engine calls -------------------------------------------------------------------
    def stepped(self, sync_s: float) -> None:
        """After each inner step: time it (less ``sync_s``, the sync inside it) and tell the
        others when it changed (their grace: see :meth:`grace`). The median of the last few
        steps: an evaluation or a checkpoint between two steps is not a slower site. A site
        made slow on purpose (``slow:``) sleeps inside its steps, so that counts."""
        now = time.perf_counter()
        if self._last_step is not None:
            self._recent.append(max(now - self._last_step - sync_s, 0.0))
            self.step_s = statistics.median(self._recent)
            told = self._told
            if len(self._recent) == 2 or (told and abs(self.step_s - told) > 0.2 * told):
                self._told = self.step_s
                self._post(_key(0, f"pace{self._site}"), f"{self.step_s:.6f}")
        self._last_step = now

    def synced(self) -> None:
        """A round was cut short and its sync done since the last step: not step time."""
        self._last_step = time.perf_counter()

    def cut(self, steps: int) -> None:
        """This site ends its round ``steps`` inner steps early (a quorum reached the sync)."""
        self.cut_rounds += 1
        self.cut_steps += steps

    def missed(self) -> None:
        """This site missed a sync it had arrived at (back from a missed one, its heal there
        failed): counted as late."""
        self.late_syncs += 1

    def closing(self, send_step: int, remaining: int) -> bool:
        """Between inner steps, ``remaining`` before the sync at ``send_step``: whether to go
        to it now. Yes once a quorum has arrived there, unless every remaining step fits in
        the first half of the grace window (equal sites then all do their full H steps)."""
        if self._count(send_step) < self.quorum:
            return False
        seen = self._seen.setdefault(send_step, time.monotonic())
        budget = self.grace() / 2 - (time.monotonic() - seen)
        return remaining * self.step_s > budget

    def arrive(self, step: int) -> bool:
        """At the sync of ``step``: tell the others, then wait until it closes. False: this
        site is late (the sync closed without it): it skips this sync."""
        self._seen.pop(step, None)
        if step == self._admitted:  # in that sync's quorum already: nothing to wait for (the
            return True  # others' hints went to their stores before this site was known)
        if self._has(_key(step, "closed")):
            self.late_syncs += 1
            self.stale = True
            self._post(_key(0, f"stale{self._site}"))  # the others wait for it at its next sync
            log.warning(
                "site %d: late for sync@%d (it closed on a quorum); it skips it and "
                "asks back in at its next sync",
                self._site,
                step,
            )
            return False
        self._post(_key(step, "arrived"))
        self._post(_key(step, f"at{self._site}"))
        if self.stale:
            self._post(_key(step, "stale"))
        self._wait(step)
        return True

    def reached(self, site: int, tag: str) -> bool:
        """Whether ``site`` told this site it reached sync ``tag`` (its arrival hint)."""
        step = step_of(tag)
        return tag.startswith("sync@") and step >= 0 and self._has(_key(step, f"at{site}"))

    def admitted(self, step: int) -> None:
        """A joiner: the quorum of the sync at ``step`` admitted it (it healed there)."""
        self._admitted = step

    def back(self) -> None:
        """This site took part in a sync: it is no longer behind."""
        if self.stale:
            self.stale = False
            self._post(_key(0, f"stale{self._site}"), "0")

    def stale_arrived(self, step: int) -> bool:
        """Whether a late site has reached the sync of ``step`` (it asks back in there: the
        members offer it the run's state, as for a joiner)."""
        return self._has(_key(step, "stale"))

    def expect(self, view: View, tag: str) -> None:
        """After ``tag`` stood on ``view``: whom to expect at the next sync. Its members, and a
        site not in it while it has missed only this one sync or says it is coming back (it
        missed one and asks back in at its next); not one whose store is gone (it died)."""
        known = {d.site: d.store for d in view.data}
        stores = {s: known.get(s) or self._stores.get(s) for s in view.members}
        # whose hints are read: these processes, and an expected site's last one
        incs = {**self._incs, **{d.site: d.inc for d in view.data if d.inc}}
        newcomer = bool(self._told) and incs != self._incs
        self._incs = incs
        behind = set(self._behind())
        for s, address in self._stores.items():
            if s in view.members or address in self._dead:
                self._missed.pop(s, None)
                continue
            if tag.startswith("sync@"):
                self._missed[s] = self._missed.get(s, 0) + 1
            if self._missed.get(s, 0) <= 1 or s in behind:
                stores[s] = address
        self._stores = {s: a for s, a in stores.items() if a and a not in self._dead}
        if newcomer:  # a new process among them: its pace came unread; to its store too
            self._post(_key(0, f"pace{self._site}"), f"{self._told:.6f}")

    def grace(self) -> float:
        """Seconds a closed quorum waits for the rest: ``grace=``, or 3x the slowest expected
        site's step time as each told it (every one then reaches a step boundary, sees the
        quorum and arrives in time); until every site has told, it waits for all of them."""
        if self.grace_s > 0:
            return self.grace_s
        paces = self._values([_key(0, f"pace{s}") for s in self._stores or [self._site]])
        if None in paces:
            return self.membership.elastic.timeout_s
        return 3 * max(float(v or 0) for v in paces) + _AUTO_MARGIN_S

    # -- inside ----------------------------------------------------------------------------------
    def _wait(self, step: int) -> None:
        """Until every expected site has arrived, the sync was closed by another, or a quorum
        has arrived and the grace window has passed (then this site closes it). A site whose
        store has gone (it died since the last sync) is no longer expected, and the quorum
        is at most the sites left."""
        returning = [_key(step, f"at{s}") for s in self._behind()]
        deadline = time.monotonic() + self.membership.elastic.timeout_s
        quorum_at: float | None = None
        probed = time.monotonic()
        while time.monotonic() < deadline:
            if time.monotonic() - probed > _PROBE_S:  # a site that exited since
                probed = time.monotonic()
                self._post(_key(step, f"waiting{self._site}"))
            live = [s for s, a in self._stores.items() if a not in self._dead] or [self._site]
            expected = [_key(step, f"at{s}") for s in live]
            if self._has(*expected) or self._has(_key(step, "closed")):
                return
            # a site that missed a sync is waited for at its next one (else a site whose step
            # is longer than the grace window would never get back in)
            if self._count(step) >= min(self.quorum, len(live)) and self._has(*returning):
                quorum_at = quorum_at or time.monotonic()
                if time.monotonic() - quorum_at >= self.grace():
                    self._post(_key(step, "closed"))
                    return
            time.sleep(_POLL_S)
        # too few sites arrived for too long: the lighthouse and min_workers decide

    def _behind(self) -> list[int]:
        """The expected sites that missed a sync and have not been back since."""
        keys = {
            s: _key(0, f"stale{s}")
            for s, a in self._stores.items()
            if s != self._site and a not in self._dead
        }
        values = self._values(list(keys.values()))
        return [s for s, v in zip(keys, values) if v == "1"]

    def _count(self, step: int) -> int:
        """How many sites have arrived at the sync of ``step``: a counter in this site's store,
        or with a run secret, the sites whose own arrival hint carries a valid MAC (a bare
        counter cannot carry one: a forged add would cut every round short)."""
        if not self._admission.keyed:
            return int(self._own.add(_key(step, "arrived"), 0))
        sites = sorted({*self._stores, self._site})
        return sum(v is not None for v in self._values([_key(step, f"at{s}") for s in sites]))

    def _has(self, *keys: str) -> bool:
        """Whether every hint of ``keys`` is in this site's own store (with a valid MAC)."""
        if not self._own.check(list(keys)):  # one round trip, as often as every 2 ms
            return False
        return not self._admission.keyed or None not in self._values(list(keys))

    def _values(self, keys: list[str]) -> list[str | None]:
        """The hints of ``keys`` in this site's own store: None for one absent (or forged)."""
        whole = bool(keys) and self._own.check(keys)  # the common case: one round trip
        present = keys if whole else [k for k in keys if self._own.check([k])]
        raws = dict(zip(present, self._own.multi_get(present))) if present else {}
        return [
            self._whose(self._admission.read_hint(k, raws[k])) if k in raws else None for k in keys
        ]

    def _whose(self, text: str | None) -> str | None:
        """A hint's value if its writer (``value#site.inc``) is a known member's process (or
        no member is known yet), else None."""
        if text is None:
            return None
        value, _, writer = text.rpartition("#")
        site, _, inc = writer.partition(".")
        if not self._incs or self._incs.get(int(site) if site.isdigit() else -1) == inc:
            return value
        return None

    def _post(self, key: str, value: str = "1") -> None:
        """Add this hint to this site's store now and to every expected site's store from that
        store's posting thread (a peer that hung must not hold this site, or the hints to the
        other peers, up)."""
        self._write(self._own, key, value)
        for site, address in self._stores.items():
            if site != self._site and address not in self._dead:
                self._queue(address).put((key, value))

    def _queue(self, address: str) -> queue.Queue[tuple[str, str]]:
        posts = self._posts.get(address)
        if posts is None:
            posts = self._posts[address] = queue.Queue()
            threading.Thread(
                target=self._post_loop,
                args=(address, posts),
                name=f"lowcomm-rounds-{address}",
                daemon=True,
            ).start()
        return posts

    def _post_loop(self, address: str, posts: queue.Queue[tuple[str, str]]) -> None:
        """Deliver the hints for one peer's store, in order, until that store fails once."""
        client = None
        while address not in self._dead:
            key, value = posts.get()
            try:
                if client is None:
                    host, port = address.rsplit(":", 1)
                    client = dist.TCPStore(
                        host, int(port), is_master=False, timeout=timedelta(seconds=2)
                    )
                self._write(client, key, value)
            except Exception as err:  # a lost site: its hints no longer matter
                self._dead.add(address)
                log.debug("site %d: hint %s to %s failed: %s", self._site, key, address, err)

    def _write(self, store: Any, key: str, value: str) -> None:
        if key.endswith("/arrived"):
            store.add(key, 1)
        else:
            signed = f"{value}#{self._site}.{self.membership.incarnation}"
            store.set(key, self._admission.hint(key, signed).encode())

    @property
    def _site(self) -> int:
        return self.membership.elastic.site


def _key(step: int, what: str) -> str:
    return f"lowcomm-rounds/{step}/{what}"
