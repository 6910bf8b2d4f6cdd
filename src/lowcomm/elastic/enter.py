"""A site launched on its own (``lowcomm train ... site=N sites=S lighthouse=HOST:PORT``, one
command per site, on its own machine): does it start the run with the others, or join the run
that is going (a site started again after it died)? The lighthouse says.

The site asks as a joiner would, marked as entering. In the quorum it is answered with:
- members of the run past its start (their requests name a sync): the run is going, and the
  site joins it as any joiner does (:meth:`Membership.join`: admitted at a sync, healed there);
- members at the start: the run is starting: the site starts with them;
- only entering sites: once every site of the run (0 .. S-1) is among them, every one of them,
  reading the same quorum, starts the run; until then they ask again, for ``timeout_s`` at most.
"""

from __future__ import annotations

import time

from ..errors import MembershipError
from .decide import View, attempt_of, run_tag
from .membership import Membership


def enter(m: Membership) -> tuple[View, str] | None:
    """None: start the run with the others (:meth:`Membership.start`); else the view and the
    sync that admit this site into the running run (it heals there). A site of several ranks
    asks on its rank 0; every rank gets the answer."""
    admitted = m.lead(lambda: _enter(m))
    if admitted is not None:
        m.generation = attempt_of(admitted[0])  # as every member reads it
    return admitted


def _enter(m: Membership) -> tuple[View, str] | None:
    e = m.elastic
    if e.back:  # its folder's run is unfinished: it continues only a run that is going
        return m.join()
    deadline = time.monotonic() + e.timeout_s
    while True:
        view = m.joiner.ask()
        old = [d for d in view.data if not d.join] if view is not None else []
        if old:
            if run_tag(view) in (None, "start"):  # type: ignore[arg-type]
                return None
            return m.join(view)  # this quorum may admit it already: read it, not the next
        entering = {
            d.site
            for d in (view.data if view is not None else [])
            if d.enter and d.fp == m.fingerprint
        }
        if entering >= set(range(e.sites)):
            return None
        if time.monotonic() > deadline:
            raise MembershipError(
                f"site {e.site}: no run is going at {e.lighthouse} (one that ended is not "
                f"joined) and only sites {sorted(entering)} of its {e.sites} asked to start "
                f"within {e.timeout_s:g} s: start the others (site=N sites={e.sites}, the same "
                f"settings), or check lighthouse=" + m.admission.explain()
            )
        time.sleep(e.heartbeat_s)
