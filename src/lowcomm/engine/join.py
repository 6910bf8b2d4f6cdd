"""A site joining a running run: it heals from a live peer, then takes part in the sync that
admitted it without a contribution of its own, so it leaves that sync with the same shared
state as every other site (compared by digest, never assumed).

What it is handed is the run's shared state as of that sync's send: results due at that step
taken but not yet applied (CO2's previous round), nothing else in flight (the overlap rule puts
every other result before the next send), so it applies them at the same step as the others."""

from __future__ import annotations

from typing import Any

from ..elastic import View
from ..errors import ConfigError


def join_run(engine: Any, view: View, tag: str) -> None:
    """Heal ``engine`` from the run's lowest old member on the admitting ``view``'s group,
    start its local weights from the global copy, then run sync ``tag`` with the others."""
    runner = engine.membership
    state = engine.state

    def load(shared: dict[str, Any]) -> dict[str, Any]:
        state.load_shared(shared)
        engine._local.load(None)  # per-site state starts fresh: local weights := global
        for frag in engine.fragments:  # ... and nothing of its own sent (continue merge)
            if frag.snapshot is not None:
                frag.take_snapshot()
        return state.shared_state_dict()  # what this engine now holds, for the digest

    runner.heal_in(view, tag, load)
    step = engine.step
    if tag != f"sync@{step}":
        raise ConfigError(f"healed at {tag} but the run's step is {step}: a lowcomm bug")
    engine.run_due(step)
