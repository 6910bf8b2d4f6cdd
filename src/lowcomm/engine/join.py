"""A site joining a running run: it heals from a live peer, then takes part in the sync that
admitted it without a contribution of its own, so it leaves that sync with the same shared
state as every other site (compared by digest, never assumed)."""

from __future__ import annotations

from typing import Any

from ..elastic import View
from ..errors import ConfigError


def check_joinable(overlap: int) -> None:
    """Joins need a sync that blocks every site (nothing in flight to hand over): a
    ConfigError for a run whose syncs overlap compute (``overlap`` = τ; CO2's is H)."""
    if overlap > 0:
        raise ConfigError(
            "a site can join only a run whose syncs do not overlap compute for now "
            "(overlap=0; not co2): results in flight are not handed over yet"
        )


def join_run(engine: Any, view: View, tag: str) -> None:
    """Heal ``engine`` from the run's lowest old member on the admitting ``view``'s group,
    start its local weights from the global copy, then run sync ``tag`` with the others."""
    runner = engine.membership
    state = engine.state

    def load(shared: dict[str, Any]) -> dict[str, Any]:
        state.load_shared(shared)
        engine._local.load(None)  # per-site state starts fresh: local weights := global
        return state.shared_state_dict()  # what this engine now holds, for the digest

    runner.heal_in(view, tag, load)
    step = engine.step
    if tag != f"sync@{step}":
        raise ConfigError(f"healed at {tag} but the run's step is {step}: a lowcomm bug")
    engine.run_due(step)
