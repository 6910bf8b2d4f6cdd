"""Who is in the run, decided by torchft's lighthouse, and the data-plane group of each quorum.

The lighthouse (``torchft.coordination.LighthouseServer``, Rust) keeps the members' heartbeats
and forms a quorum from the sites that ask for one: every live member of the last quorum, or,
once a member's heartbeat has lapsed, those still alive. lowcomm asks once per outer sync, not
per inner step. The bytes never go through the lighthouse: each quorum gets a gloo group of its
own, built on the store that its first member hosts, under a prefix naming the run, the quorum
and the attempt (``torch.distributed.PrefixStore``), so two groups never share a connection.

Every exchange is settled by a second quorum, the commit: each member reports whether its
collectives completed; the result stands only if every member of the commit quorum completed
the same sync with the same members. Otherwise all of them retry on a new quorum with the same
encoded bytes, so a result is never applied by some survivors and not by others.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, MembershipError

log = logging.getLogger("lowcomm")


@dataclass(frozen=True)
class Elastic:
    """Membership settings: ``LowComm(..., elastic=Elastic(lighthouse=..., site=..., sites=3))``.

    A site is one member of the run (one process for now); the run goes on while at least
    ``min_workers`` sites remain. Every wait is bounded: a site whose heartbeat lapses for
    ``heartbeat_timeout_s`` (the lighthouse's setting) is left out, a collective with a dead
    peer fails within ``timeout_s``.
    """

    lighthouse: str  # address of a running LighthouseServer (``http://host:port``)
    site: int  # this site's number, 0-based; unique in the run
    sites: int  # how many sites start the run (the first quorum waits for all of them)
    min_workers: int = 1  # fewer live sites than this stop the run with one line
    run_id: str = "lowcomm"  # names the run's stores, so two runs on a lighthouse never mix
    heartbeat_s: float = 0.2  # how often this site tells the lighthouse it is alive
    timeout_s: float = 60.0  # bound on one quorum wait and on one collective
    connect_s: float = 10.0  # bound on every member reaching a new quorum's group
    leave_after: str = ""  # replay: leave the run once this sync (a tag) has been settled

    def __post_init__(self) -> None:
        if not isinstance(self.lighthouse, str) or not self.lighthouse:
            raise ConfigError("elastic needs lighthouse=ADDRESS of a running torchft lighthouse")
        if not 0 <= self.site < self.sites:
            raise ConfigError(f"site must be in [0, sites={self.sites}), got {self.site}")
        if not 1 <= self.min_workers <= self.sites:
            raise ConfigError(
                f"min_workers must be in [1, sites={self.sites}], got {self.min_workers}"
            )

    @property
    def replica_id(self) -> str:
        """This site's name at the lighthouse (sorted names give the ranks)."""
        return f"site{self.site:04d}"


@dataclass
class View:
    """One quorum as this site sees it: its members in rank order and what each reported."""

    quorum_id: int
    members: list[int]  # site numbers, rank order
    data: list[dict[str, Any]] = field(default_factory=list)

    def rank_of(self, site: int) -> int:
        """This quorum's rank of ``site``."""
        return self.members.index(site)


class Membership:
    """This site's membership: heartbeats, quorums, the commit vote and each quorum's group."""

    def __init__(self, elastic: Elastic) -> None:
        from torchft.coordination import LighthouseClient

        self.elastic = elastic
        timeout = timedelta(seconds=elastic.timeout_s)
        self._client = LighthouseClient(elastic.lighthouse, connect_timeout=timeout)
        self._beat_client = LighthouseClient(elastic.lighthouse, connect_timeout=timeout)
        # this site hosts a store; the group of a quorum lives on its first member's store
        host = os.environ.get("LOWCOMM_ADDR", "127.0.0.1")
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.store_address = f"{host}:{self._store.port}"
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        self._stop = threading.Event()
        self._beat_client.heartbeat(elastic.replica_id)
        self._beats = threading.Thread(target=self._beat, name="lowcomm-heartbeat", daemon=True)
        self._beats.start()
        atexit.register(self.close)  # groups aborted before torch tears itself down

    def _beat(self) -> None:
        while not self._stop.wait(self.elastic.heartbeat_s):
            try:
                self._beat_client.heartbeat(self.elastic.replica_id)
            except Exception as e:  # the lighthouse is gone: the next quorum says so
                log.debug("heartbeat failed: %s", e)

    def quorum(self, tag: str, ok: bool = True) -> View:
        """Wait for the next quorum, reporting ``tag`` (which sync) and ``ok`` (did this site
        complete it); raises MembershipError when this site is out or too few remain."""
        e = self.elastic
        try:
            q = self._client.quorum(
                replica_id=e.replica_id,
                timeout=timedelta(seconds=e.timeout_s),
                address=self.store_address,
                store_address=self.store_address,
                step=0,
                world_size=1,
                shrink_only=False,
                data={"site": e.site, "tag": tag, "ok": ok, "store": self.store_address},
            )
        except Exception as err:
            raise MembershipError(
                f"site {e.site}: no quorum within {e.timeout_s:g} s at {tag} ({err}): fewer than "
                f"min_workers={e.min_workers} sites may remain, or the lighthouse is gone"
            ) from None
        data = sorted((dict(m.data or {}) for m in q.participants), key=lambda d: d["site"])
        view = View(int(q.quorum_id), [int(d["site"]) for d in data], data)
        if e.site not in view.members:
            raise MembershipError(f"site {e.site} was left out of the run at {tag}: it stops here")
        return view

    def start(self) -> View:
        """The first quorum that holds every starting site (an early one may form while a
        site is still starting up: it is asked again)."""
        view = self.quorum("start")
        while len(view.members) < self.elastic.sites:
            view = self.quorum("start")
        return view

    def check(self, view: View, tag: str) -> None:
        """Stop this site, with one line, if it fell behind the others or too few remain."""
        e = self.elastic
        behind = [d["site"] for d in view.data if d["tag"] != tag]
        if behind:
            raise MembershipError(
                f"site {e.site} is at {tag} while sites {behind} are elsewhere: this site was "
                f"left out (its heartbeat lapsed or it fell behind) and stops here"
            )
        if len(view.members) < e.min_workers:
            raise MembershipError(
                f"only {len(view.members)} sites remain ({view.members}), fewer than "
                f"min_workers={e.min_workers}: the run stops"
            )

    def group(self, view: View, generation: int = 0) -> dist.ProcessGroup:
        """The gloo group of ``view``'s members for attempt ``generation`` (made once each;
        the groups of older quorums and attempts are aborted)."""
        key = (view.quorum_id, generation)
        if key in self._groups:
            return self._groups[key]
        for old in self._groups.values():  # done with, or broken by a failed attempt
            old.abort()
        self._groups = {}
        host, port = view.data[0]["store"].rsplit(":", 1)
        if view.members[0] == self.elastic.site:
            store = self._store
        else:
            store = dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=self.elastic.timeout_s)
            )
        prefix = dist.PrefixStore(f"{self.elastic.run_id}/q{view.quorum_id}/g{generation}/", store)
        rank, size = view.rank_of(self.elastic.site), len(view.members)
        _arrive(prefix, rank, size, self.elastic.connect_s)
        group = _gloo_group(prefix, rank, size, self.elastic.timeout_s)
        self._groups[key] = group
        return group

    def close(self) -> None:
        """Stop the heartbeats (the lighthouse then leaves this site out) and the groups."""
        self._stop.set()
        for group in self._groups.values():
            group.abort()
        self._groups.clear()


def _arrive(store: Any, rank: int, size: int, connect_s: float) -> None:
    """Wait at most ``connect_s`` for every member to reach this group's store; raises
    RuntimeError (a failed attempt: the runner retries among those left) when one does not.

    A member lost after the quorum formed but before it connected would otherwise hold the
    others in gloo's own rendezvous for the whole collective timeout."""
    store.set(f"arrived/{rank}", b"1")
    keys = [f"arrived/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=connect_s))
    except RuntimeError as e:  # torch's DistStoreError is one
        raise RuntimeError(
            f"a member did not reach the group within connect_s={connect_s:g} s ({e})"
        ) from None


def _gloo_group(store: Any, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo ProcessGroup on ``store`` that torch's default world does not need to know."""
    timeout = timedelta(seconds=timeout_s)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group
