"""Building an engine's parts once its group is known: each part declares its own state when
built, in load order, so checkpoints, heals and leaving the block all read one list.

:func:`wire` returns the parts as one :class:`Parts`, which ``LowComm`` keeps as its own
attribute: nothing here sets anything on the engine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..aggregate import Aggregator, make_aggregator
from ..compensation import make_compensation
from ..config import SyncConfig
from ..elastic import Elastic, View
from ..transport import Transport
from .build import build_fragments, register_optimizer_state
from .check import Offenders, UpdateCheck
from .fragment import Fragment, register_fragment_state
from .guards import NonFiniteGuard, ReplicaCheck
from .leave import Leave
from .local import LocalWeights
from .state import StatePart
from .stats import register_counters
from .sync import Apply, Encoder, Exchange, InFlight

if TYPE_CHECKING:
    from ..compensation import ErrorFeedback, MovingAverageCompensation
    from ..elastic import Runner
    from ..outer import OuterOptimizer
    from ..protocols import SyncHooks
    from ..schedule import Schedule
    from ..transport import TransportFactory
    from .placement import Placement
    from .state import RunState
    from .stats import SyncStats, SyncTimes
    from .sync import Merge


class Built(Protocol):
    """What :func:`wire` reads of an engine built but not started (a LowComm: core imports
    this module, so the engine is described here rather than imported)."""

    config: SyncConfig
    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer
    fragment_names: list[list[str]]
    schedule: Schedule
    outer: OuterOptimizer
    state: RunState
    stats: SyncStats
    sync_times: SyncTimes
    _placement: Placement
    _by_name: dict[str, torch.Tensor]
    _merge: Merge
    transports: TransportFactory
    hooks: SyncHooks

    def fingerprint(self) -> str:
        """What every site of the run must share, hashed."""
        ...


@dataclasses.dataclass(frozen=True)
class Parts:
    """Every part of a started engine, built once on its group by :func:`wire`. Frozen: a
    part is never swapped for another while the run goes on (their state is, by loading)."""

    transport: Transport  # the sync exchanges and control flags (its meter: training bytes)
    buffer_transport: Transport  # buffer averaging, on a meter of its own
    aggregator: Aggregator  # codec and reduce, chosen for the run's starting size
    compensation: ErrorFeedback | MovingAverageCompensation | None  # error feedback, if any
    fragments: list[Fragment]  # global copies, snapshots and unsent counts, schedule order
    inflight: InFlight  # results sent and not yet applied
    nonfinite: NonFiniteGuard  # non-finite pseudo-gradients left out, and their streak
    local: LocalWeights  # this worker's weights, kept or published outside the block
    encoder: Encoder  # compensate and encode a fragment's pseudo-gradient
    membership: Runner | None  # with elastic=: runs each sync on the live quorum
    exchange: Exchange  # the collectives of one sync
    replica: ReplicaCheck  # the periodic check that every worker holds the same global copy
    apply: Apply  # outer step and merge of a result
    leave: Leave  # the exit path of the with block


def wire(engine: Built, step: StatePart) -> tuple[Parts, tuple[View, str] | None]:
    """Join the group and build every part of ``engine`` on it; ``step`` is the engine's own
    step counter as a state part (registered here, at its place in the load order).

    A fixed world or a starting site gets every worker's parameters from rank 0; a site joining
    a running run gets none here (it heals next) and is also given the view and sync that
    admitted it (else None)."""
    cfg, placement, state = engine.config, engine._placement, engine.state
    group = placement.join(engine.fingerprint())
    admission = placement.admission
    transport = engine.transports(group, None)
    buffer_transport = engine.transports(group, None)  # its own meter: buffer bytes apart
    # the codec and reduce chosen for the run's starting size, the same on a joiner
    size = placement.elastic.sites if placement.elastic is not None else transport.world_size
    aggregator = make_aggregator(cfg, size)
    compensation = make_compensation(cfg, _compensation_device(cfg))
    frags = build_fragments(
        engine.fragment_names,
        engine._by_name,
        cfg,
        placement,
        None if admission is not None else transport,
        engine._merge,
    )
    register_fragment_state(state, frags)
    register_optimizer_state(state, engine.outer, compensation, aggregator, transport)
    state.register("step", step)
    inflight = InFlight(transport, state)
    nonfinite = NonFiniteGuard(cfg.nonfinite_patience, engine.stats, state, transport.rank)
    register_counters(state, engine.stats, transport.meter)
    local = LocalWeights(engine.model, frags, placement, state)
    runner = placement.runner(transport, buffer_transport, engine.transports, engine.hooks)
    encoder = _encoder(engine, aggregator, compensation, nonfinite, transport.rank, runner)
    exchange = Exchange(
        engine.model,
        frags,
        buffers=cfg.buffers,
        aggregator=aggregator,
        transport=transport,
        buffer_transport=buffer_transport,
        stats=engine.stats,
        times=engine.sync_times,
        runner=runner,
        most_steps=2 * engine.schedule.sync_every,
    )
    replica = ReplicaCheck(transport, exchange.on_group, engine.stats, runner, engine.hooks)
    apply = _apply(engine, frags, inflight, nonfinite, compensation, runner)
    # offenders are told apart by their contributions' norms: a robust rule's gather gives them
    aggregator.track = cfg.offender_syncs > 0 and not aggregator.rule.sum_decomposable
    leave = _leave(engine, frags, transport, exchange, inflight)
    parts = Parts(
        transport=transport,
        buffer_transport=buffer_transport,
        aggregator=aggregator,
        compensation=compensation,
        fragments=frags,
        inflight=inflight,
        nonfinite=nonfinite,
        local=local,
        encoder=encoder,
        membership=runner,
        exchange=exchange,
        replica=replica,
        apply=apply,
        leave=leave,
    )
    return parts, admission


def _encoder(
    engine: Built,
    aggregator: Aggregator,
    compensation: ErrorFeedback | MovingAverageCompensation | None,
    nonfinite: NonFiniteGuard,
    rank: int,
    runner: Runner | None,
) -> Encoder:
    """The encoder, and whether a send may leave its finite check on the device: a fixed world
    (an elastic runner decides before it sends) without round overlap (a result told only
    after the next send would restart the worker a sync late, the next send already made from
    the bad weights)."""
    round_overlap = engine.schedule.is_round_overlap()
    aggregator.deferred_checks = runner is None and not round_overlap
    in_flight = 2 if round_overlap else 1
    return Encoder(aggregator, compensation, nonfinite, rank, engine.hooks, in_flight=in_flight)


def _apply(
    engine: Built,
    frags: list[Fragment],
    inflight: InFlight,
    nonfinite: NonFiniteGuard,
    compensation: ErrorFeedback | MovingAverageCompensation | None,
    runner: Runner | None,
) -> Apply:
    """The outer step and merge of a result, with the checks on what arrives."""
    cfg = engine.config
    return Apply(
        engine.model,
        engine.inner_optimizer,
        frags,
        engine.outer,
        engine._merge,
        merge_at_first_send=engine.schedule.is_round_overlap(),
        inflight=inflight,
        guard=nonfinite,
        placement=engine._placement,
        times=engine.sync_times,
        compensation=compensation,
        check=UpdateCheck(cfg.update_bound, engine.state),
        offenders=Offenders(cfg.offender_syncs, cfg.evict, engine.stats, runner),
    )


def _leave(
    engine: Built,
    frags: list[Fragment],
    transport: Transport,
    exchange: Exchange,
    inflight: InFlight,
) -> Leave:
    """The exit path of the with block."""
    return Leave(
        engine.model,
        frags,
        engine._placement,
        transport=transport,
        exchange=exchange,
        inflight=inflight,
        outer=engine.outer,
        consumed=0 if engine._merge.needs_snapshot else engine.schedule.overlap,
    )


def fingerprint(
    elastic: Elastic | None,
    cfg: SyncConfig,
    by_name: Mapping[str, torch.Tensor],
    fragment_names: list[list[str]],
    ranks: int = 1,
) -> str:
    """What every site of one run must share, hashed: the run id, the sync settings (but where
    a site keeps its state and which kernels it runs), the fragments' parameter names, shapes
    and dtypes, and how many ranks a site has ("" without ``elastic``: a fixed world checks
    nothing here)."""
    if elastic is None:
        return ""
    settings: dict[str, Any] = dataclasses.asdict(cfg)
    settings.pop("state_device", None)
    settings.pop("kernels", None)  # every implementation gives the same bits
    shapes = [
        [(n, list(by_name[n].shape), str(by_name[n].dtype)) for n in frag]
        for frag in fragment_names
    ]
    # how contributions are merged: the same everywhere
    rounds = [elastic.rounds, elastic.late, elastic.weighting]
    what = [elastic.run_id, settings, shapes, rounds] + ([ranks] if ranks > 1 else [])
    text = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compensation_device(cfg: SyncConfig) -> str | None:
    """Error buffers live on the state device (None: the model's, where the pseudo-gradients
    they compensate are)."""
    return cfg.state_device if cfg.state_device != "model" else None
