"""Reading a quorum off the wire, as every member reads it: each participant's request parsed
(:meth:`.messages.Request.from_wire`) and screened (:class:`.admission.Admission`), only this
run's requests kept (its settings, its shape), and the names at the lighthouse that came with
requests that failed.

Names. torchft's lighthouse keeps the last request per name and hands every participant's name
to everyone in a quorum, so any process that saw a quorum can take a site's name: its requests
then replace the site's. A site that finds a request under its name that is not its own takes a
fresh name (its run id, its number and a random suffix) and asks again; the members ask again
too, while a member of the last sync is missing and its name came with junk. Both for at most
``timeout_s`` (then the site stops alone with one line, and the others go on). Sites are told
apart by their requests' authenticated fields, never by the name.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from ..errors import MembershipError
from .messages import Request, replica_name

log = logging.getLogger("lowcomm")


class Reader:
    """This site's reading of its quorums, and its name at the lighthouse."""

    def __init__(self, elastic: Any, fingerprint: str, admission: Any, ranks: int) -> None:
        self.elastic, self.fingerprint, self.admission = elastic, fingerprint, admission
        self.ranks = ranks  # this site's ranks: every site of a run has as many
        self._base = replica_name(elastic.run_id, elastic.site)
        self.name = self._base  # this site's name at the lighthouse now (see the module)
        self.displaced_since: float | None = None  # its request was another's under its name
        self.taken: set[int] = set()  # sites whose names came with requests that failed
        self._refused: set[int] = set()  # sites already told they were refused

    def read(
        self, participants: list[Any], join: bool, incarnation: str, seq: int
    ) -> list[Request]:
        """The requests of a quorum's ``participants`` a member reads (sorted by site), one per
        site: the newest (a copy of an older one, replayed under another of its names, is
        junk); a joiner (``join``) reads other runs' too, to say why it is refused. ``seq``:
        this site's own request (another under its name displaced it)."""
        pairs = [(m.replica_id, Request.from_wire(m.data, m.replica_id)) for m in participants]
        self.admission.ignored += sum(r is None for _, r in pairs)  # counted, as a bad MAC is
        good = _newest(self.admission.screen([r for _, r in pairs if r is not None]))
        kept = {id(r) for r in good}
        junk = [name for name, r in pairs if r is None or id(r) not in kept]
        self.taken = {s for s in map(self._site_of, junk) if s is not None}
        me = self.elastic.site
        mine = any(d.site == me and d.inc == incarnation and d.seq == seq for d in good)
        self._displaced(not mine and self.name in {name for name, _ in pairs})
        data = sorted(good, key=lambda d: d.site)
        return data if join else self._same_run(data)

    def may_wait(self) -> bool:
        """Whether this site, displaced from its name, still asks again (for ``timeout_s``)."""
        since = self.displaced_since
        return since is not None and time.monotonic() - since < self.elastic.timeout_s

    def _displaced(self, displaced: bool) -> None:
        if not displaced:
            self.displaced_since = None
            return
        self.displaced_since = self.displaced_since or time.monotonic()
        log.warning("site %d: another process asked under this site's name %s; it asks again "
                    "under a new one", self.elastic.site, self.name)  # fmt: skip
        self.name = f"{self._base}/{secrets.token_hex(4)}"

    def _site_of(self, name: str) -> int | None:
        """The site of this run a name at the lighthouse claims (None: another run's, or none)."""
        prefix = replica_name(self.elastic.run_id, 0)[:-4]
        number = name[len(prefix) : len(prefix) + 4]
        return int(number) if name.startswith(prefix) and number.isdigit() else None

    def _same_run(self, data: list[Request]) -> list[Request]:
        """The requests of this run: a member with other settings or another run id (the
        fingerprint holds both), a joiner's aside, is no member of it. A site of this run id
        that is no joiner (one starting with the run) with other settings stops every site that
        sees it, itself too, with one line: the run cannot start as asked."""
        e = self.elastic
        keep = [d for d in data if d.join or d.fp == self.fingerprint]
        for d in keep:
            if not d.join:
                self.same_shape(d)
        for d in data:
            if d not in keep and d.run == e.run_id:
                raise MembershipError(
                    f"site {e.site}: site {d.site} of run {e.run_id} has other settings (model, "
                    f"strategy or codec: {d.fp} vs {self.fingerprint}): start every site of a "
                    f"run with the same settings"
                )
            if d not in keep:
                self.refused(d, "a site %d of another run or with other settings (%s) asked "
                                "this lighthouse; not a member")  # fmt: skip
        return keep

    def refused(self, asker: Request, message: str) -> None:
        """Warn, once per site, of a request from ``asker`` this site refused."""
        if asker.site not in self._refused:
            self._refused.add(asker.site)
            log.warning("site %d: " + message, self.elastic.site, asker.site, asker.fp)

    def same_shape(self, d: Request) -> None:
        """Every site of a run has as many ranks (each syncs its shard with the same rank of
        the others): a member of another shape stops this site with one line."""
        if d.ranks != self.ranks:
            raise MembershipError(
                f"site {self.elastic.site} has {_ranks(self.ranks)} but site {d.site} of the "
                f"run has {_ranks(d.ranks)}: every site of a run needs the same number of ranks "
                f"(torchrun --nproc-per-node) and the same sharding"
            )


def _newest(requests: list[Request]) -> list[Request]:
    """Of several requests of one site in a quorum (a valid one copied under another of its
    names), the newest only."""
    newest: dict[int, Request] = {}
    for d in requests:
        if d.site not in newest or d.seq > newest[d.site].seq:
            newest[d.site] = d
    return [d for d in requests if newest[d.site] is d]


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")
