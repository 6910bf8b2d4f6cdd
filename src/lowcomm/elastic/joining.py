"""The joiner's side of a site's membership: asking the lighthouse, as a joiner, until the
run admits this site at a sync (a site started again, an added one, or a late site asking back
in under quorum rounds). A :class:`~.membership.Membership` holds one and asks through it; a
site of several ranks runs it on its rank 0 (``Membership.join`` and ``rejoin`` hand the answer
to every rank)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from ..errors import MembershipError
from .decide import View, admits, admitted_at, asking, run_tag, step_of


class Asker(Protocol):
    """What a :class:`Joiner` asks through: a site's membership
    (:class:`~.membership.Membership`), which holds the lighthouse link and the settings."""

    elastic: Any
    fingerprint: str
    asking_back_at: str  # a late site asking back in: the sync it asks for ("" otherwise)
    admission: Any  # its screen (:class:`~.admission.Admission`): what it could not authenticate
    reader: Any  # its reading of quorums (:class:`~.reading.Reader`): refuses another shape

    def ask(self, tag: str, ok: bool, phase: str, join: bool, ready: bool) -> View:
        """One quorum request to the lighthouse, and the view it answers."""
        ...


class Joiner:
    """Asking to join, through a site's membership: until the run admits this site at a sync
    (:meth:`join`), or a late site back in at one (:meth:`rejoin`)."""

    def __init__(self, membership: Asker) -> None:
        self.membership = membership

    def join(self, first: View | None) -> tuple[View, str]:
        """The view that admits this site and its sync's tag (see ``Membership.join``)."""
        m = self.membership
        alone_since: float | None = None
        while True:
            asked = time.monotonic()
            view, first = (first, None) if first is not None else (self.ask(), None)
            old = [d for d in view.data if not d.join] if view else []
            if not old:
                alone_since = self._alone(asked, alone_since, answered=view is not None)
                continue
            ref = old[0]
            m.reader.same_shape(ref)
            if ref.fp != m.fingerprint:
                raise MembershipError(
                    f"site {m.elastic.site} was refused by the run: its settings differ "
                    f"(run id, model, strategy or codec: {m.fingerprint} vs the run's "
                    f"{ref.fp}); start it with the run's settings"
                )
            admitted, ref = admitted_at(view, m.fingerprint)
            if admits(admitted, m.elastic.site, m.elastic.min_workers):
                return admitted, ref.tag

    def rejoin(self, tag: str) -> View | None:
        """The view that admits this late site back at ``tag``, or None (see
        ``Membership.rejoin``)."""
        m = self.membership
        step = step_of(tag)
        m.asking_back_at = tag
        alone_since: float | None = None
        try:
            while True:
                asked = time.monotonic()
                view = self.ask()
                old = [d for d in view.data if not d.join] if view else []
                if view is None or not old:  # the others gone (the run over) stops it here
                    alone_since = self._alone(asked, alone_since, view is not None, tag)
                    continue
                admitted, ref = admitted_at(view, m.fingerprint)
                if admits(admitted, m.elastic.site, m.elastic.min_workers):
                    return admitted
                if step_of(ref.tag) > step:
                    return None
        finally:
            m.asking_back_at = ""

    def ask(self) -> View | None:
        """One quorum as a joiner; None when it timed out (the run's sites are alive but
        between syncs: the lighthouse holds a lone joiner until they ask)."""
        asked = time.monotonic()
        try:  # read as the members read their quorum: their votes are no members (see asking)
            view = self.membership.ask("join", True, "join", join=True, ready=False)
            return asking(view, run_tag(view) or "")
        except MembershipError:
            if time.monotonic() - asked < self.membership.elastic.timeout_s:
                raise  # at once: the lighthouse is gone
            return None

    def _alone(
        self, asked: float, since: float | None, answered: bool, back_at: str = ""
    ) -> float | None:
        """Only joiners asked. The lighthouse answers a lone joiner at once only when no other
        site beats (the run is over, or not on this lighthouse): give up after ``timeout_s``
        of that. Returns since when this joiner has been alone (None: others are alive).
        ``back_at``: a site asking back in at that sync (it missed the one before)."""
        e = self.membership.elastic
        now = time.monotonic()
        since = (since or asked) if answered and now - asked < e.timeout_s / 2 else None
        if since is not None and now - since > e.timeout_s:
            if back_at:
                raise MembershipError(
                    f"site {e.site} missed a sync and asked back in at {back_at}, but no other "
                    f"site has been in the run for {e.timeout_s:g} s (it is over): it stops here"
                )
            unfinished = ""
            if e.back:  # started into its folder's unfinished run: say why it is not continued
                unfinished = (
                    " (its folder holds an unfinished run: a run whose sites all "
                    "stopped is not continued; give a fresh --out, or --overwrite)"
                )
            raise MembershipError(
                f"site {e.site} found no run to join at {e.lighthouse} (run id {e.run_id}): "
                f"start it while the run is going{unfinished}" + self.membership.admission.explain()
            )
        time.sleep(e.heartbeat_s)
        return since
