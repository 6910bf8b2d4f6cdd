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
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ..errors import MembershipError
from .front import END, ENDED, FRESH_S, PROOF, REFUSED, STALE, beat_request, served_run
from .messages import proof_of

log = logging.getLogger("lowcomm")

# back after an outage, a site asks the lighthouse only after this many heartbeat periods, and
# never sooner than every live site's beat channel has reconnected (see settle_s): a restarted
# lighthouse forms a quorum of those who ask once every site it has heard from asks, so a
# member whose beat lands late is left out
SETTLE_BEATS = 5
# gRPC's reconnect backoff grows to this (its own default grows to minutes), with up to 20 %
# jitter: the longest a beat channel lags a lighthouse that is back
RECONNECT_MAX_MS = 250


def settle_s(heartbeat_s: float) -> float:
    """How long a site back from an outage waits before it asks: SETTLE_BEATS heartbeat
    periods, and at least the longest reconnect of another site's beat channel plus two
    periods (its next beat sent, and received)."""
    return max(SETTLE_BEATS * heartbeat_s, 1.2 * RECONNECT_MAX_MS / 1000 + 2 * heartbeat_s)


class Link:
    """This site's clients of the lighthouse (one for quorums, one for the heartbeat thread).
    With ``admission`` keyed, the lighthouse must prove it holds the run's key (a keyed front:
    an open lighthouse is refused, with one line) and each beat is sealed."""

    def __init__(
        self, elastic: Any, seal: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        name: Callable[[], str] | None = None, admission: Any = None, inc: str = "",
    ) -> None:  # fmt: skip
        # elastic: a membership.Elastic (it imports this module); seal: adds a request's MAC;
        # name: this site's name at the lighthouse now (it changes if taken: see .reading);
        # admission (an .admission.Admission) and inc (this process): a keyed site's beats
        from torchft.coordination import LighthouseClient

        self.elastic = elastic
        self.name = name or (lambda: elastic.replica_id)
        self._seal = seal or (lambda data: data)
        self._admission = admission if admission is not None and admission.keyed else None
        self._inc, self._beat_seq = inc, 0
        if self._admission is not None:
            prove(elastic, self._admission)
        self.epoch = 0  # lighthouse outages seen (or heard of from a quorum): names groups
        self.sent_seq = 0  # the seq its last quorum request was sent with (see quorum)
        # when the last heartbeat that found the lighthouse unreachable was sent, and when this
        # site last found it back: an outage since then is waited out before the next quorum
        self._lost_at, self._back_at = -1.0, 0.0
        timeout = timedelta(seconds=elastic.timeout_s)
        self._client = LighthouseClient(elastic.lighthouse, connect_timeout=timeout)
        self._beat_client = LighthouseClient(elastic.lighthouse, connect_timeout=timeout)
        self._stop = threading.Event()
        self._send_beat(self._beat_client)
        self._beats = threading.Thread(target=self._beat, name="lowcomm-heartbeat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.elastic.heartbeat_s):
            sent = time.monotonic()
            try:
                self._send_beat(self._beat_client)
            except Exception as e:  # the lighthouse is away: the next quorum waits for it
                log.debug("heartbeat failed: %s", e)
                self._lost_at = sent

    def _send_beat(self, client: Any) -> None:
        """One heartbeat under this site's name: by torchft's ``client``, or sealed (a keyed
        site's), by a call of its own to the same method."""
        if self._admission is None:
            client.heartbeat(self.name())
            return
        # stamped by the clock, never back (as a quorum request's seq)
        self._beat_seq = max(time.time_ns(), self._beat_seq + 1)
        name = self.name()
        seal = self._admission.beat(name, self._inc, self._beat_seq)
        _call(self.elastic.lighthouse, BEAT, beat_request(name.encode(), seal), BEAT_S)

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
                if ENDED in str(err):  # the others finished the run while this site was away
                    raise MembershipError(_ended(e.site, str(err), tag)) from None
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

    def end(self, tag: str) -> None:
        """A keyed site that finished the run after sync ``tag`` tells the front, which then
        refuses the run's other processes (see .front). Best effort, for a few seconds: a
        lighthouse away at the run's end leaves that gap open; an older front (that does
        not know the method) is not asked again."""
        import grpc

        if self._admission is None:
            return
        for _ in range(END_TRIES):
            word = self._admission.end(self._inc, time.time_ns(), tag)
            try:
                _call(self.elastic.lighthouse, END, word, BEAT_S)
                return
            except grpc.RpcError as err:
                log.debug("site %d: the end of the run not told: %s", self.elastic.site, err)
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    return
            time.sleep(self.elastic.heartbeat_s)

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
                self._send_beat(client)
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
        time.sleep(settle_s(e.heartbeat_s))
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


BEAT = "/torchft.LighthouseService/Heartbeat"
BEAT_S = 5.0  # bound on one heartbeat call
END_TRIES = 10  # a finished site tells the front for up to this many heartbeat periods


def _ended(site: int, details: str, tag: str) -> str:
    """The line a site stops with when the front says its run is over (see .front)."""
    # (torchft's client quotes the front's line inside its own)
    said = details.split(ENDED, 1)[1].lstrip(": ").splitlines()[0].split('"')[0]
    if tag == "join":  # asking to join, never let in: it came too late, it was not away
        why = "it ended before this site was let back in; this site stops here"
    else:
        why = (
            "it ended while this site was away from it (paused, or cut off); this site stops "
            "here, and what it holds is not the run's model"
        )
    return f"site {site}: at {tag}, the lighthouse says the run is over ({said}): {why}"


# (process, lighthouse address) -> its gRPC channel: one per process (a forked child makes its
# own: a channel does not survive a fork)
_channels: dict[tuple[int, str], Any] = {}
_channels_lock = threading.Lock()


def _call(lighthouse: str, method: str, request: bytes, timeout_s: float) -> bytes:
    """``request`` (bytes) to ``method`` of the lighthouse, its answer's bytes."""
    import grpc

    target = lighthouse.removeprefix("http://").removeprefix("https://")
    key = (os.getpid(), target)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            # reconnect within a heartbeat or so of a restarted lighthouse (gRPC's own backoff
            # grows to minutes)
            options = [("grpc.initial_reconnect_backoff_ms", 100),
                       ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]  # fmt: skip
            channel = _channels[key] = grpc.insecure_channel(target, options=options)
    return channel.unary_unary(method)(request, timeout=timeout_s)  # type: ignore[no-any-return]


def prove(elastic: Any, admission: Any) -> None:
    """A keyed site's first call: the lighthouse answers a fresh nonce with its MAC under the
    run's key, or this site stops here with one line (an open lighthouse, which a stranger can
    take a member's name at; a front of another secret, or of another run). An unreachable one
    is asked again for ``timeout_s``, as a quorum waits for it."""
    import grpc

    e = elastic
    nonce = os.urandom(16).hex()
    request = proof_of(e.run_id, nonce)
    deadline = time.monotonic() + e.timeout_s
    while True:
        try:
            answer = _call(e.lighthouse, PROOF, request, BEAT_S).decode(errors="replace")
            break
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise MembershipError(
                    f"site {e.site}: the lighthouse at {e.lighthouse} is open (it holds no "
                    f"secret), and this site holds the run's: a stranger there could keep a "
                    f"dead site alive or take a member's name; serve the run with `lowcomm "
                    f"lighthouse --secret-file F --run-id {e.run_id}` (or start the sites "
                    f"without secret_file=)"
                ) from None
            served = served_run(details)
            if served is not None:
                raise MembershipError(
                    f"site {e.site}: the lighthouse at {e.lighthouse} serves run {served} "
                    f"only, and this site is of run {e.run_id}: give it run_id={served} (or "
                    f"start the lighthouse with --run-id {e.run_id})"
                ) from None
            if time.monotonic() >= deadline:
                why = details.splitlines()[0] if details else str(code)
                raise MembershipError(
                    f"site {e.site}: the lighthouse at {e.lighthouse} was unreachable for "
                    f"{e.timeout_s:g} s (timeout_s) ({why}): start it, or give the sites its "
                    f"address"
                ) from None
            time.sleep(e.heartbeat_s)
    if answer != admission.proof(nonce):
        raise MembershipError(
            f"site {e.site}: the lighthouse at {e.lighthouse} holds another secret than this "
            f"site's: give the site and `lowcomm lighthouse --secret-file` the same one"
        )
