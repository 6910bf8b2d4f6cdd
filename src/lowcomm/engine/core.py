"""``LowComm``: the front class. It hooks the inner optimizer and, after every inner step, runs
what the schedule says is due as named calls on the engine's parts (see the package doc)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..config import ConfigError, SyncConfig
from ..elastic import Elastic
from ..elastic.rounds import Rounds
from ..outer import OuterOptimizer, make_outer
from ..protocols import CommitVote, Contribution, SyncHooks
from ..schedule import Schedule
from ..transport import Transport, TransportFactory
from .build import check_arguments, resolve_fragments, trainable_params
from .join import check_healed_at, join_run, rejoin
from .placement import Placement, check_elastic_config
from .quorum import cut_short, in_round
from .state import RunState, StatePart
from .stats import SyncStats, SyncTimes, Unblocked
from .sync import counted, make_merge, send
from .wiring import Parts, fingerprint, wire


def _part(name: str, before: Any, doc: str) -> Any:
    """A read-only attribute of the engine that is one of its parts (``before`` until the
    first start builds them)."""

    def get(engine: LowComm) -> Any:
        parts = engine._parts
        return getattr(parts, name) if parts is not None else before

    return property(get, doc=f"{doc} {before!r} before the first start.")


class LowComm:
    """Low-communication training around an existing (model, inner optimizer) pair.

    Use as a context manager; it hooks ``inner_optimizer.step()`` so the training loop stays
    unchanged::

        sync = lowcomm.DiLoCo(model, opt, sync_every=50)
        with sync:
            for x, y in batches:
                model(x, y).backward(); opt.step(); opt.zero_grad()
        print(sync.stats)

    ``config.fragments`` is a count (the blocks are found in the model); explicit lists of
    module or parameter names go in ``fragment_modules``.

    Extension points: ``transports`` makes every transport between workers (``Transport``
    itself by default: a subclass may wrap its collectives), for the fixed world and for each
    quorum of an elastic run; ``register_contribution_hook``, ``register_vote_hook`` and
    ``register_checksum_hook`` act on a sync (:class:`~lowcomm.protocols.SyncHooks`).

    A worker can be a whole site: give ``mesh``, a 2-D DeviceMesh with a ``"replicate"``
    dimension (one entry per worker) and the model sharded with FSDP2 ``fully_shard`` over the
    other, or wrapped in DDP over it. Each rank then syncs its own shard (under DDP: its slice
    of every weight's rows, shared inside the worker after each sync) only with the ranks at the
    same position in the other workers. (``process_group`` gives that outer group directly.)
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: SyncConfig | None = None,
        *,
        fragment_modules: list[list[str]] | None = None,
        process_group: dist.ProcessGroup | None = None,
        mesh: Any = None,
        timeout_s: float = 300.0,
        elastic: Elastic | None = None,
        transports: TransportFactory = Transport,
        **overrides: Any,
    ) -> None:
        check_arguments(model, inner_optimizer, config, timeout_s, overrides)
        self._placement = Placement(model, process_group, mesh, float(timeout_s), elastic)
        self.config = dataclasses.replace(config or SyncConfig(), **overrides)
        check_elastic_config(self.config, elastic, mesh)
        self.model, self.inner_optimizer = model, inner_optimizer
        self._by_name = trainable_params(model, inner_optimizer)
        self.fragment_names = resolve_fragments(model, self.config, fragment_modules)
        self.schedule = Schedule(self.config.sync_every, len(self.fragment_names), self.config.tau)
        self._merge = make_merge(self.config, self.schedule)
        self.transports = transports
        self.hooks = SyncHooks()
        self._hook: Any = None
        self.step = 0
        self.last_sync_step = -1  # the last step at which anything was sent or applied
        self.stats = SyncStats()
        self.sync_times = SyncTimes()  # always on: a few perf_counter calls per sync
        self.outer: OuterOptimizer = make_outer(self.config)
        self.state = RunState()
        # built on the joined group at the first start (a group exists only inside the block)
        self._parts: Parts | None = None
        self._started = False
        self.healed = False  # this site joined a running run: it healed from its members
        # a state_dict loaded before start(), and whether it is for a world of another size
        self._loaded: tuple[dict[str, Any], bool] | None = None

    # -- the parts -------------------------------------------------------------------------------
    @property
    def parts(self) -> Parts:
        """Every part built on the joined group (:class:`.wiring.Parts`); once started."""
        if self._parts is None:
            raise ConfigError("the engine's parts exist once it has started: enter the block")
        return self._parts

    transport = _part("transport", None, "The sync exchanges' transport (its meter: the bytes).")
    aggregator = _part("aggregator", None, "The codec and reduce of the run.")
    compensation = _part("compensation", None, "The error compensation, if any.")
    membership = _part("membership", None, "With elastic=: who is in each sync (a Runner).")
    fragments = _part("fragments", [], "The fragments in schedule order.")

    def register_contribution_hook(self, hook: Callable[[Contribution], None]) -> RemovableHandle:
        """Call ``hook(c)`` on each contribution this worker makes, before it is compensated
        and encoded (:class:`~lowcomm.protocols.SyncHooks`); returns a removable handle."""
        return self.hooks.register_contribution_hook(hook)

    def register_vote_hook(
        self, hook: Callable[[CommitVote], CommitVote | None]
    ) -> RemovableHandle:
        """Let ``hook(vote)`` replace the commit votes this site casts (elastic runs)."""
        return self.hooks.register_vote_hook(hook)

    def register_checksum_hook(self, hook: Callable[[int], int | None]) -> RemovableHandle:
        """Let ``hook(value)`` replace the replica checksums this site reports."""
        return self.hooks.register_checksum_hook(hook)

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> LowComm:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    def start(self) -> None:
        """Join the workers (same initial model everywhere) and hook the inner optimizer.

        Entering again after leaving continues the same run from the kept local weights.
        """
        if self._started:
            return
        if self._parts is None:
            self._first_start()
        else:
            self._parts.local.reenter()
        self.parts.local.started = True
        self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        self._started = True

    def _first_start(self) -> None:
        """Build the parts on the joined group (:func:`.wiring.wire`) and load a state_dict
        given before; a site that joins a running run then heals from a live peer and takes
        part in the sync that admitted it."""
        step = StatePart(lambda: self.step, self._load_step, kept=False, shared=True)
        self._parts, admission = wire(self, step)
        self.healed = admission is not None
        if self._loaded is not None:
            (sd, new_world), self._loaded = self._loaded, None
            self._load(sd, new_world)
        if admission is not None:
            view, tag = admission
            tag = join_run(self._parts, self.state, view, tag)
            check_healed_at(tag, self.step)
            self.run_due(self.step)

    def fingerprint(self) -> str:
        """What every site of this run must share, hashed (:func:`.wiring.fingerprint`); the
        empty string without elastic=."""
        place = self._placement
        ranks = max(1, len(place.site_ranks))
        return fingerprint(place.elastic, self.config, self._by_name, self.fragment_names, ranks)

    def _load_step(self, value: Any) -> None:
        """The step counter's state part loads here: the engine owns its step."""
        self.step = int(value)

    def finish(self) -> None:
        """Leave the block: wait for every worker, then load the consolidated model
        (see the package doc)."""
        if not self._started:
            return
        self._remove_hook()
        parts = self.parts
        meter = parts.transport.meter
        with Unblocked(meter) as spent:
            unsent, last = parts.leave.join_peers(self.step, self.run_due)
            parts.replica.collect()
            kept = self.state.keep()
            sent0 = meter.sent_bytes
            parts.leave.drain(parts.apply.one)
            parts.leave.final_outer_step(unsent, last, parts.encoder.encode)
            parts.leave.sync_buffers(last)
            self.stats.final_syncs += 1
            self.stats.final_sync_bytes_sent += meter.sent_bytes - sent0
            parts.local.publish()
            self.state.restore(kept)
        self.stats.outer_s += spent.seconds
        self.close()

    def close(self) -> None:
        """Remove the optimizer hook and stop the comm thread (no final sync: after an error)."""
        self._remove_hook()
        if self._parts is not None:
            self._parts.transport.close()
            self._update_stats()
            self._parts.local.started = False
        self._started = False

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- the outer loop --------------------------------------------------------------------------
    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        self.stats.inner_steps = self.step
        self.stats.trained_steps += 1
        parts = self.parts
        for frag in parts.fragments:
            frag.unsent += 1
        parts.encoder.count_step(parts.transport)
        t0 = time.perf_counter()
        self.run_due(self.step)
        rounds = self._rounds
        if rounds is not None:
            rounds.stepped(time.perf_counter() - t0)  # its step time is the time outside syncs
            cut_short(rounds, self.schedule, self.step, self._skip_to)

    def _skip_to(self, target: int) -> None:
        """A quorum round cut short: step on to ``target`` now, running what each skipped
        step has due (results applied as they would have been), no inner step taken."""
        while self.step < target:
            self.step += 1
            self.run_due(self.step)
        self.stats.inner_steps = self.step

    @property
    def _rounds(self) -> Rounds | None:
        """The quorum rounds of this site (None in lock-step)."""
        runner = self.membership
        return runner.rounds if runner is not None else None

    def _rejoin(self, tag: str, carry: bool) -> bool:
        """Quorum rounds: heal at sync ``tag`` after missing one (:func:`.join.rejoin`)."""
        return rejoin(self.parts, self.state, self._placement, tag, carry)

    def run_due(self, step: int, joining: bool = False) -> torch.Tensor | None:
        """Do what the schedule says is due after inner step ``step``: take the results due,
        encode and submit the fragments due, apply the results.

        ``joining``: this worker has left its loop and only mirrors its peers' syncs. Returns
        the control flags when that showed every worker has left (nothing was exchanged).
        """
        parts = self.parts
        sends = self.schedule.sends_at(step)
        if (
            sends
            and not joining
            and not in_round(self._rounds, step, parts.transport.meter, self._rejoin)
        ):
            sends = []  # quorum rounds: this sync closed without this site
        due = parts.inflight.due(step, sends)
        if not sends and (joining or not due):
            # a worker that has left mirrors collectives only: results due are applied by the
            # next sync or the drain, so a run that re-enters applies them at the same step
            return None
        with Unblocked(parts.transport.meter) as spent:
            parts.replica.collect()
            flags = None
            if sends and joining:
                flags = parts.exchange.gather_flags(
                    parts.exchange.flags(step, done=True), f"flags@{step}"
                )
                if parts.leave.everyone_left(flags):
                    return flags  # every worker has left: stop before exchanging anything
            results = {p: parts.inflight.take(p) for p in due}
            if sends:
                send(parts, self.schedule, self.sync_times, self.state, sends, step, flags, results)
            parts.apply.results(sends, results, parts.transport.world_size, step)
            self.last_sync_step = step
            if sends:
                counted(parts, self.stats, self.schedule, self.config.replica_check_every,
                        len(sends), step)  # fmt: skip
        self.stats.outer_s += spent.seconds
        self.sync_times.caller += spent.seconds
        self._update_stats()
        return None

    # -- the run state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything this worker needs to continue identically: save it on every rank.

        Tensors and plain types only. Local weights are included; results still in flight are
        awaited and stored as pending, not applied early, so a resumed run applies them at the
        same step as an uninterrupted one would.
        """
        if self._parts is None:
            raise ConfigError("state_dict() needs a started run: enter the with block first")
        self._parts.replica.collect()
        self._update_stats()
        return self.state.state_dict()

    def load_state_dict(self, sd: dict[str, Any], new_world: bool = False) -> None:
        """Continue a run saved with ``state_dict()`` (this rank's file).

        Before the block: applied when it starts (after the start-up broadcast). Inside or
        between blocks: applied now. ``new_world``: the run resumes on another number of
        workers (``sd`` is one worker's): the run's global state carries over and every worker
        starts afresh from the global copy (:meth:`.state.RunState.afresh`; ``local=None`` in
        ``sd`` alone does the latter).
        """
        if self._parts is None:
            self._loaded = (sd, new_world)
            return
        self._load(sd, new_world)

    def _load(self, sd: dict[str, Any], new_world: bool) -> None:
        self.state.load_state_dict(self.state.afresh(sd) if new_world else sd)

    # -- inspection ------------------------------------------------------------------------------
    def global_parameters(self) -> contextlib.AbstractContextManager[nn.Module]:
        """Temporarily load the global parameters into the model (e.g. to evaluate theta_global).

        Outside the block the model already holds the published (consolidated) model.
        """
        if not self._started:
            return contextlib.nullcontext(self.model)
        return self.parts.local.global_loaded()

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global parameters by name: the run's global copy inside the block, the
        consolidated model that leaving loaded into every worker outside it."""
        return self._parts.local.global_state() if self._parts is not None else {}

    def global_flat(self) -> torch.Tensor:
        """All global parameters (as :meth:`global_state`) as one flat FP32 tensor,
        fragment order."""
        state = self.global_state()
        return torch.cat([state[n].reshape(-1).float() for f in self.fragments for n in f.names])

    def _update_stats(self) -> None:
        if (parts := self._parts) is not None:
            meters = (parts.transport.meter, parts.buffer_transport.meter)
            self.stats.read_meters(*meters, self._placement.inner, self.sync_times)
