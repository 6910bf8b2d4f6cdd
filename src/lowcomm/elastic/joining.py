"""The joiner's side of a site's membership: asking the lighthouse, as a joiner, until the
run admits this site at a sync (a site started again, an added one, or a late site asking back
in under quorum rounds). :class:`~.membership.Membership` is one; a site of several ranks runs
these on its rank 0 (``Membership.join`` and ``rejoin`` hand the answer to every rank)."""

from __future__ import annotations

import time
from typing import Any

from ..errors import MembershipError
from .decide import View, admits, admitted_at, asking, run_tag, step_of


class Joining:
    """Asking to join; the rest of the membership (``_ask``, ``elastic``, ``fingerprint``,
    ``_join_at``, ``_same_shape``) is :class:`~.membership.Membership`'s."""

    elastic: Any
    fingerprint: str
    _join_at: str

    def _ask(self, tag: str, ok: bool, phase: str, join: bool, ready: bool) -> View:
        raise NotImplementedError  # Membership's

    def _same_shape(self, d: dict[str, Any]) -> None:
        raise NotImplementedError  # Membership's

    def _join(self, first: View | None) -> tuple[View, str]:
        """:meth:`join` of this process (a site's rank 0)."""
        alone_since: float | None = None
        while True:
            asked = time.monotonic()
            view, first = (first, None) if first is not None else (self._ask_to_join(), None)
            old = [d for d in view.data if not d.get("join")] if view else []
            if not old:
                alone_since = self._alone(asked, alone_since, answered=view is not None)
                continue
            ref = old[0]
            self._same_shape(ref)
            if ref.get("fp") != self.fingerprint:
                raise MembershipError(
                    f"site {self.elastic.site} was refused by the run: its settings differ "
                    f"(run id, model, strategy or codec: {self.fingerprint} vs the run's "
                    f"{ref.get('fp')}); start it with the run's settings"
                )
            admitted, ref = admitted_at(view, self.fingerprint)
            if admits(admitted, self.elastic.site, self.elastic.min_workers):
                return admitted, ref["tag"]

    def _rejoin(self, tag: str) -> View | None:
        """:meth:`rejoin` of this process (a site's rank 0)."""
        step = step_of(tag)
        self._join_at = tag
        alone_since: float | None = None
        try:
            while True:
                asked = time.monotonic()
                view = self._ask_to_join()
                old = [d for d in view.data if not d.get("join")] if view else []
                if view is None or not old:  # the others gone (the run over) stops it here
                    alone_since = self._alone(asked, alone_since, view is not None, tag)
                    continue
                admitted, ref = admitted_at(view, self.fingerprint)
                if admits(admitted, self.elastic.site, self.elastic.min_workers):
                    return admitted
                if step_of(ref["tag"]) > step:
                    return None
        finally:
            self._join_at = ""

    def _ask_to_join(self) -> View | None:
        """One quorum as a joiner; None when it timed out (the run's sites are alive but
        between syncs: the lighthouse holds a lone joiner until they ask)."""
        asked = time.monotonic()
        try:  # read as the members read their quorum: their votes are no members (see asking)
            view = self._ask("join", True, "join", join=True, ready=False)
            return asking(view, run_tag(view) or "")
        except MembershipError:
            if time.monotonic() - asked < self.elastic.timeout_s:
                raise  # at once: the lighthouse is gone
            return None

    def _alone(
        self, asked: float, since: float | None, answered: bool, back_at: str = ""
    ) -> float | None:
        """Only joiners asked. The lighthouse answers a lone joiner at once only when no other
        site beats (the run is over, or not on this lighthouse): give up after ``timeout_s``
        of that. Returns since when this joiner has been alone (None: others are alive).
        ``back_at``: a site asking back in at that sync (it missed the one before)."""
        e = self.elastic
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
                f"start it while the run is going{unfinished}"
            )
        time.sleep(e.heartbeat_s)
        return since
