"""Building an engine's parts once its group is known: each part declares its own state when
built, in load order, so checkpoints, heals and leaving the block all read one list."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from ..aggregate import make_aggregator
from ..compensation import make_compensation
from ..config import SyncConfig
from ..elastic import View
from ..transport import Transport
from .apply import Apply
from .build import build_fragments, register_optimizer_state
from .encode import Encoder
from .exchange import Exchange
from .fragment import register_fragment_state
from .guards import NonFiniteGuard, ReplicaCheck
from .inflight import InFlight
from .leave import Leave
from .local import LocalWeights
from .state import StatePart
from .stats import register_counters


def wire(engine: Any) -> tuple[View, str] | None:
    """Join the group and build every part of ``engine`` on it. A fixed world or a starting
    site gets every worker's parameters from rank 0; a site joining a running run gets none
    here (it heals next) and is told the view and sync that admitted it. (``engine`` is the
    LowComm being started, typed loosely: core imports this module.)"""
    cfg, placement, state = engine.config, engine._placement, engine.state
    group = placement.join(fingerprint(engine))
    admission = placement.admission
    engine.transport = transport = Transport(group, delay_s=engine._comm_delay_s)
    engine._buffer_transport = Transport(group)  # its own meter: buffer bytes apart
    # the codec and reduce chosen for the run's starting size, the same on a joiner
    size = placement.elastic.sites if placement.elastic is not None else transport.world_size
    engine.aggregator = make_aggregator(cfg, size)
    engine.compensation = make_compensation(cfg, _compensation_device(cfg))
    engine.fragments = frags = build_fragments(
        engine.fragment_names, engine._by_name, cfg, placement,
        None if admission is not None else transport, engine._merge,
    )  # fmt: skip
    register_fragment_state(state, frags)
    register_optimizer_state(state, engine.outer, engine.compensation, engine.aggregator, transport)
    state.register(
        "step",
        StatePart(
            lambda: engine.step, lambda v: setattr(engine, "step", int(v)), kept=False, shared=True
        ),
    )
    engine._inflight = InFlight(transport, engine.events, state)
    engine._nonfinite = NonFiniteGuard(cfg.nonfinite_patience, engine.stats, state)
    register_counters(state, engine.stats, transport.meter)
    engine._local = LocalWeights(engine.model, frags, placement, state)
    engine._encoder = Encoder(
        engine.aggregator, engine.compensation, engine._nonfinite, transport.rank,
        in_flight=2 if engine.schedule.is_round_overlap() else 1,
    )  # fmt: skip
    engine.membership = runner = placement.runner(
        engine.aggregator, transport, engine._buffer_transport
    )
    engine._exchange = Exchange(
        engine.model, frags, cfg.buffers, engine.aggregator, transport, engine._buffer_transport,
        engine.stats, engine.sync_times, engine.events, runner,
    )  # fmt: skip
    engine._replica = ReplicaCheck(transport, engine._exchange.on_group, engine.stats)
    engine._apply = Apply(
        engine.model, engine.inner_optimizer, frags, engine.outer, engine._merge,
        engine.schedule.is_round_overlap(), engine._inflight, engine._nonfinite, placement,
        engine.sync_times,
    )  # fmt: skip
    engine._leave = Leave(
        engine.model, frags, placement, transport, engine._exchange, engine._inflight,
        engine.outer, engine.events, 0 if engine._merge.needs_snapshot else engine.schedule.overlap,
    )  # fmt: skip
    if engine._loaded is not None:
        sd, engine._loaded = engine._loaded, None
        state.load_state_dict(sd)
    return admission


def fingerprint(engine: Any) -> str:
    """What every site of one run must share, hashed: the run id, the sync settings (but where
    a site keeps its state) and the fragments' parameter names, shapes and dtypes."""
    elastic = engine._placement.elastic
    if elastic is None:
        return ""
    cfg: dict[str, Any] = dataclasses.asdict(engine.config)
    cfg.pop("state_device", None)
    shapes = [
        [(n, list(engine._by_name[n].shape), str(engine._by_name[n].dtype)) for n in frag]
        for frag in engine.fragment_names
    ]
    rounds = [elastic.rounds, elastic.late]  # how contributions are merged: the same everywhere
    text = json.dumps([elastic.run_id, cfg, shapes, rounds], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compensation_device(cfg: SyncConfig) -> str | None:
    """Error buffers live on the state device (None: the model's, where the pseudo-gradients
    they compensate are)."""
    return cfg.state_device if cfg.state_device != "model" else None
