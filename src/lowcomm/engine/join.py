"""A site joining a running run: it heals from a live peer, then takes part in the sync that
admitted it without a contribution of its own, so it leaves that sync with the same shared
state as every other site (compared by digest, never assumed).

What it is handed is the run's shared state as of that sync's send: results due at that step
taken but not yet applied (CO2's previous round), nothing else in flight (the overlap rule puts
every other result before the next send), so it applies them at the same step as the others."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..elastic import View
from ..errors import ConfigError, MembershipError
from .tensors import views

log = logging.getLogger("lowcomm")

if TYPE_CHECKING:  # wiring imports the parts this module's functions take
    from ..elastic import Runner
    from .placement import Placement
    from .state import RunState
    from .wiring import Parts


def join_run(parts: Parts, state: RunState, view: View, tag: str) -> str:
    """Heal from the run's old members on the admitting ``view``'s group and start the
    local weights from the global copy; the engine then runs the sync it returns (``tag``, or
    a later one: a heal whose healer died mid-hand-over is asked for again, and healed from
    another member, where the run admits this site next)."""

    def load(shared: dict[str, Any]) -> dict[str, Any]:
        state.load_shared(shared)
        parts.local.load(None)  # per-site state starts fresh: local weights := global
        for frag in parts.fragments:  # ... and nothing of its own sent (continue merge)
            if frag.snapshot is not None:
                frag.take_snapshot()
        return state.shared_state_dict()  # what this engine now holds, for the digest

    runner = _runner(parts)
    while True:
        try:
            runner.heal_in(view, tag, load)
            return tag
        except MembershipError:
            raise  # the heal was not bit-exact, or this site is out: asking again is no cure
        except (RuntimeError, ValueError) as err:  # the healer (or a member) went mid-way
            why = str(err).splitlines()[0][:160]
            log.warning("the heal at %s failed (%s); asking to join again", tag, why)
            view, tag = runner.join_again()


def check_healed_at(tag: str, step: int) -> None:
    """A heal at sync ``tag`` must have loaded the run's ``step`` of that sync."""
    if tag != f"sync@{step}":
        raise ConfigError(f"healed at {tag} but the run's step is {step}: a lowcomm bug")


def rejoin(parts: Parts, state: RunState, placement: Placement, tag: str, carry: bool) -> bool:
    """Quorum rounds: a site that missed a sync heals at sync ``tag`` from the run's shared
    state as a joiner does; False when the others had already gone past ``tag``.

    ``carry``: its local weights move by what the run's model moved since its own copy (the
    syncs it missed), so its next pseudo-gradient is exactly the work it did against the model
    it started from, and its unsent steps stay: the merge weights it by all of them. Otherwise
    (``late=drop``, and merges that keep a snapshot of what was sent, CO2's) it starts again
    from the run's model, its work since its last sync dropped."""
    frags = parts.fragments
    keep = carry and all(f.snapshot is None for f in frags)

    def load(shared: dict[str, Any]) -> dict[str, Any]:
        before = [f.global_flat.clone() for f in frags]
        state.load_shared(shared)
        if keep:
            with torch.no_grad():
                for f, old in zip(frags, before):
                    moved = f.global_flat - old
                    for p, d in zip(f.params, views(moved, f.params)):
                        p.add_(d.to(device=p.device, dtype=p.dtype))
            placement.share_parts(frags)
        else:
            parts.local.load(None)
            for frag in frags:
                frag.unsent = 0
                if frag.snapshot is not None:
                    frag.take_snapshot()
        return state.shared_state_dict()

    return bool(_runner(parts).rejoin(tag, load))


def _runner(parts: Parts) -> Runner:
    """The membership runner: joining and rejoining exist only with elastic=."""
    runner = parts.membership
    if runner is None:
        raise ConfigError("a site joins a run only with elastic=: a lowcomm bug")
    return runner
