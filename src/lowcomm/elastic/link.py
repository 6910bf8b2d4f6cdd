"""A site's connection to the lighthouse: its heartbeats, and quorum requests that wait out the
lighthouse's absence (it died and is being started again at the same address).

A request that cannot reach the lighthouse (refused, reset: anything but torchft's own
TimeoutError, which means the lighthouse answered that no quorum formed) is asked again, on a
new client, once a heartbeat lands again; for at most ``timeout_s`` from the first failure, then
the site stops with one line naming the lighthouse. ``epoch`` counts the outages this site saw
(or heard of: :meth:`Link.adopt`); group names carry it (:func:`.groups.group_name`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import MembershipError
from .front import FRESH_S, REFUSED, STALE, served_run

log = logging.getLogger("lowcomm")

# back after an outage, a site asks the lighthouse only after this many heartbeat periods: every
# live site's heartbeat (retried every period) has reached the restarted lighthouse by then
SETTLE_BEATS = 5


class Link:
    """This site's clients of the lighthouse (one for quorums, one for the heartbeat thread)."""

    def __init__(
        self, elastic: Any, seal: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        name: Callable[[], str] | None = None,
    ) -> None:  # fmt: skip
        # elastic: a membership.Elastic (it imports this module); seal: adds a request's MAC;
        # name: this site's name at the lighthouse now (it changes if taken: see .reading)
        from torchft.coordination import LighthouseClient

        self.elastic = elastic
        self.name = name or (lambda: elastic.replica_id)
        self._seal = seal or (lambda data: data)
        self.epoch = 0  # lighthouse outages seen (or heard of from a quorum): names groups
        self.sent_seq = 0  # the seq its last quorum request was sent with (see quorum)
        # when the last heartbeat that found the lighthouse unreachable was sent, and when this
        # site last found it back: an outage since then is waited out before the next quorum
        self._lost_at, self._back_at = -1.0, 0.0
        timeout = timedelta(seconds=elastic.timeout_s)
        self._client = LighthouseClient(elastic.lighthouse, connect_timeout=timeout)
        self._beat_client = LighthouseClient(elastic.lighthouse, connect_timeout=timeout)
        self._stop = threading.Event()
        self._beat_client.heartbeat(self.name())
        self._beats = threading.Thread(target=self._beat, name="lowcomm-heartbeat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.elastic.heartbeat_s):
            sent = time.monotonic()
            try:
                self._beat_client.heartbeat(self.name())
            except Exception as e:  # the lighthouse is away: the next quorum waits for it
                log.debug("heartbeat failed: %s", e)
                self._lost_at = sent

    def quorum(self, tag: str, data: dict[str, Any], wait_s: float, address: str) -> Any:
        """torchft's quorum for this site's request ``data`` (sent with this site's epoch as
        ``lh``), waiting at most ``wait_s`` for it to form; an unreachable lighthouse is waited
        for (see the module). Each send is stamped anew (its ``seq``, sealed: a keyed
        lighthouse's front refuses a stale one); :attr:`sent_seq` is the last stamp."""
        e = self.elastic
        if self._lost_at > self._back_at:  # it was away: back, it must know every live site
            self._reach(tag, time.monotonic())
        while True:
            asked = time.monotonic()
            # stamped by the clock, but never back: a clock stepped back by NTP must not make
            # the front refuse this site's next request as older than its last
            self.sent_seq = max(time.time_ns(), self.sent_seq + 1)
            try:
                return self._client.quorum(
                    replica_id=self.name(),
                    timeout=timedelta(seconds=wait_s),
                    address=address,
                    store_address=address,
                    step=0,
                    world_size=1,
                    shrink_only=False,
                    data=self._seal({**data, "lh": self.epoch, "seq": self.sent_seq}),
                )
            except TimeoutError as err:  # the lighthouse answered: no quorum formed
                raise MembershipError(
                    f"site {e.site}: no quorum within {wait_s:g} s at {tag} ({err}): fewer "
                    f"than min_workers={e.min_workers} sites may remain"
                ) from None
            except Exception as err:  # unreachable (refused, reset): it may be restarting
                served = served_run(str(err))
                if served is not None:  # a front serving one run: the run ids differ
                    raise MembershipError(
                        f"site {e.site}: the lighthouse at {e.lighthouse} serves run {served} "
                        f"only, and this site is of run {e.run_id}: give it "
                        f"run_id={served} (or start the lighthouse with --run-id {e.run_id})"
                    ) from None
                if REFUSED in str(err):  # a keyed lighthouse's front: this site's secret
                    raise MembershipError(
                        f"site {e.site}: the lighthouse at {e.lighthouse} refused this site's "
                        f"request: it carries no valid MAC under the run's secret (this site "
                        f"holds another, or none, or belongs to another run): give it the "
                        f"run's secret and run id"
                    ) from None
                if STALE in str(err):  # (each send is stamped anew: only clocks do this)
                    raise MembershipError(
                        f"site {e.site}: the lighthouse at {e.lighthouse} refused this site's "
                        f"request as stale: this machine's clock and the lighthouse's differ by "
                        f"more than {FRESH_S:g} s, or went back: set both by NTP"
                    ) from None
                log.warning(
                    "site %d: the lighthouse at %s is unreachable at %s (%s); asking "
                    "again for up to %g s",
                    e.site,
                    e.lighthouse,
                    tag,
                    str(err).splitlines()[0][:120],
                    e.timeout_s,
                )
                self._reach(tag, asked)

    def adopt(self, epochs: list[int]) -> None:
        """A quorum's members reported ``epochs``: a higher one is an outage this site missed."""
        self.epoch = max([self.epoch, *epochs])

    def _reach(self, tag: str, since: float) -> None:
        """The lighthouse was unreachable (since ``since``): wait until it answers a heartbeat
        again, for at most ``timeout_s`` (then this site stops with one line naming it); then
        a new client, once every live site's heartbeat had time to reach it (a restarted
        lighthouse would otherwise form a quorum of the first site asking), and a new epoch."""
        from torchft.coordination import LighthouseClient

        e = self.elastic
        deadline = since + e.timeout_s
        while True:
            try:
                client = LighthouseClient(e.lighthouse, connect_timeout=timedelta(seconds=1))
                client.heartbeat(self.name())
                self._back_at = time.monotonic()
                break
            except Exception as err:
                if time.monotonic() >= deadline:
                    raise MembershipError(
                        f"site {e.site}: the lighthouse at {e.lighthouse} was unreachable for "
                        f"{e.timeout_s:g} s (timeout_s) at {tag} ({str(err).splitlines()[0]}): "
                        f"this site stops here"
                    ) from None
                time.sleep(e.heartbeat_s)
        time.sleep(SETTLE_BEATS * e.heartbeat_s)
        self._client = client
        self.epoch += 1
        log.warning(
            "site %d: the lighthouse at %s answers again; epoch %d",
            e.site,
            e.lighthouse,
            self.epoch,
        )

    def close(self) -> None:
        """Stop the heartbeats (the lighthouse then leaves this site out)."""
        self._stop.set()
