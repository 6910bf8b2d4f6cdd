"""The one outer loop. DiLoCo, Streaming DiLoCo, SparseLoCo and CO2 are configurations of it.

After every inner ``optimizer.step()`` the engine asks the schedule what is due at this global
step and, in this order:

1. waits for the in-flight results that are due now (so at most one exchange per fragment is
   in flight: CO2 waits for round r-1's all-reduce before it starts round r's);
2. for each fragment due to be sent: its pseudo-gradient (``theta_global - theta_local``, or
   with the continue merge the progress since its last send), optional error compensation,
   encode, and start the exchange (blocking when overlap tau = 0, else on the transport's comm
   thread while training continues). Every exchange starts with a small control all-gather of
   each worker's flags (has it left its loop, its step, was its update finite, unsent steps);
3. applies each result: outer step on the fragment's global copy, then merge into the local
   weights: replace (tau = 0, or CO2's ``reset``), the alpha-mix, or *continue*: the new
   global copy minus this worker's own progress that the global copy does not hold yet (of
   its round still in flight, CO2 keeps only the share ``co2_keep``).

Leaving the ``with`` block (``finish``) follows the own-loop contract of docs/api.md: a worker
that is done takes part in its peers' remaining syncs (contributing its unsent progress once),
then every worker drains what is in flight, runs one more blocking outer step per fragment
with unsent inner steps, averages buffers, and loads that consolidated model; the run's own
state (local weights, global copies, outer and error state, results in flight) is kept, so
entering the block again continues the same run as if it had never been left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed support: no sharded parameters
    DTensor = ()  # type: ignore[assignment,misc]

from . import _buffers
from .aggregate import Aggregator, Encoded, Reduced, encode_compensated, make_aggregator
from .config import ConfigError, SyncConfig
from .errors import NonFiniteError, ReplicaMismatchError
from .outer import OuterOptimizer, make_outer
from .schedule import (
    Schedule,
    build_fragments,
    check_fragments,
    expand_fragment_modules,
    find_blocks,
)
from .transport import Transport, shutdown_at_exit

log = logging.getLogger("lowcomm")

# Columns of the per-exchange control flags (one int64 row per worker).
_DONE, _STEP, _NONFINITE, _UNSENT = 0, 1, 2, 3


@dataclass
class _Fragment:
    """One group of parameters synced together, with its global copy as one flat FP32 buffer."""

    index: int
    names: list[str]
    raw: list[nn.Parameter]  # the model's parameters (DTensors under FSDP2)
    global_flat: torch.Tensor
    global_views: list[torch.Tensor]
    buckets: list[list[int]]
    unsent: int = 0  # inner steps since this fragment was last sent
    snapshot: torch.Tensor | None = None  # continue merge: local weights at the last send
    part: tuple[int, int] | None = None  # DDP inside a worker: (this rank's part, parts)

    @property
    def key(self) -> str:
        return f"fragment{self.index}"

    @property
    def params(self) -> list[torch.Tensor]:
        """This rank's part of each parameter: the local shard under FSDP2, its slice of rows
        with DDP inside a worker, else the parameter.

        Looked up each time: FSDP2 may re-point a sharded parameter's storage at lazy init.
        """
        return [_local(p, self.part) for p in self.raw]


@dataclass
class _Event:
    """What one exchange (all fragments sent at one step) brought back."""

    flags: torch.Tensor  # [M, 3 + P] int64, every worker's control flags
    reduced: dict[int, Reduced]  # fragment -> averaged pseudo-gradient
    buffers: torch.Tensor | None = None  # averaged / broadcast floating buffers, flat FP32

    @property
    def nonfinite_workers(self) -> int:
        return int(self.flags[:, _NONFINITE].sum())


@dataclass
class _Pending:
    future: Future  # of an _Event
    sent_at: int
    apply_at: int
    own: torch.Tensor | None = None  # continue merge: what this worker sent, decoded


@dataclass
class SyncStats:
    """What a user sees in ``engine.stats``: bytes, syncs and time blocked on the network."""

    syncs: int = 0
    fragment_syncs: int = 0
    inner_steps: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    control_bytes_sent: int = 0
    control_bytes_received: int = 0
    buffer_bytes_sent: int = 0  # module buffers averaged or broadcast at syncs
    buffer_bytes_received: int = 0
    final_syncs: int = 0  # consolidations when leaving the block
    final_sync_bytes_sent: int = 0  # their training bytes (also counted in bytes_sent)
    blocked_s: float = 0.0
    outer_s: float = 0.0
    peak_bytes_per_sync: int = 0
    left_out_syncs: int = 0  # fragment syncs in which some worker was left out
    left_out_here: int = 0  # ... of which this worker was the one left out
    replica_checks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (for summaries)."""
        return dataclasses.asdict(self)


@dataclass
class SyncTimes:
    """Seconds spent in each stage of the syncs so far (``engine.sync_times``).

    Encode, outer and merge run on the caller's thread; collective and decode_sum wherever the
    exchange runs (the comm thread when overlapped). ``caller`` is the caller's time in syncs
    outside waits on an exchange and ``exchange`` the exchanges' own time: their sum is the
    work of the syncs, which the stages never exceed.
    """

    encode: float = 0.0  # pseudo-gradient, error compensation, codec encode
    collective: float = 0.0  # the wire exchange, control flags and buffers included
    decode_sum: float = 0.0  # decode the peers' payloads and average them
    outer: float = 0.0  # outer optimizer step on the global copy
    merge: float = 0.0  # the result into the local weights
    caller: float = 0.0
    exchange: float = 0.0

    @property
    def total(self) -> float:
        """The work of the syncs, on whichever thread it ran."""
        return self.caller + self.exchange


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
        comm_delay_s: float = 0.0,
        **overrides: Any,
    ) -> None:
        _check_arguments(model, inner_optimizer, config, timeout_s, overrides)
        _check_mesh(mesh, process_group)
        self.config = dataclasses.replace(config or SyncConfig(), **overrides)
        self.model = model
        self.inner_optimizer = inner_optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError(
                "the model has no trainable parameters: unfreeze some (requires_grad)"
            )
        _check_optimizer_holds(inner_optimizer, [p for _, p in named])
        self.fragment_names = self._resolve_fragments([n for n, _ in named], fragment_modules)
        self.schedule = Schedule(self.config.sync_every, len(self.fragment_names), self.config.tau)
        self._by_name = dict(named)
        self._frozen = [p for p in model.parameters() if not p.requires_grad]
        self._process_group = process_group
        self._mesh = mesh
        self._part: tuple[int, int] | None = None  # DDP inside a worker (see _share_parts)
        self._inner: Transport | None = None  # the ranks of this worker, for _share_parts
        self._timeout_s = float(timeout_s)
        self._comm_delay_s = comm_delay_s
        self._frags: list[_Fragment] = []
        self._pending: dict[int, _Pending] = {}
        self._hook: Any = None
        self.step = 0
        self.last_sync_step = -1  # the last step at which anything was sent or applied
        self.stats = SyncStats()
        self.sync_times = SyncTimes()  # always on: a few perf_counter calls per sync
        self.transport: Transport | None = None
        self._buffer_transport: Transport | None = None
        self.aggregator: Aggregator | None = None
        self.outer: OuterOptimizer = make_outer(self.config)
        self.compensation: Any = None
        # (what, fragment, time) for sent / completed / applied: lets tests and users see overlap
        self.events: list[tuple[str, int, float]] = []
        self._left_out: set[int] = set()  # fragments whose last pseudo-gradient here was non-finite
        self._nonfinite_streak = 0
        self._replica_check: Future | None = None
        self._started = False
        self._published: dict[str, torch.Tensor] | None = None  # the model loaded on leaving
        self._kept_local: dict[str, torch.Tensor] | None = None  # local weights and buffers then
        self._loaded: dict[str, Any] | None = None  # a state_dict loaded before start()

    def _resolve_fragments(
        self, names: list[str], modules: list[list[str]] | None
    ) -> list[list[str]]:
        cfg = self.config
        if modules is not None:
            if not isinstance(modules, (list, tuple)) or not modules:
                raise ConfigError(
                    "fragment_modules must be a non-empty list of lists of module "
                    "or parameter names, e.g. [['embed', 'head'], ['layers.0']]"
                )
            fragments = expand_fragment_modules(list(modules), names)
        else:
            fragments = build_fragments(
                names,
                find_blocks(self.model),
                cfg.fragments,
                cfg.blocks_per_fragment,
                cfg.fragment_pattern,
            )
        check_fragments(fragments, names)
        cfg.check_schedule(len(fragments))
        return fragments

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
        if self._frags:
            self._reenter()
        else:
            self._first_start()
        self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        self._started = True

    def _first_start(self) -> None:
        group = self._join_group()
        self.transport = Transport(group, delay_s=self._comm_delay_s)
        self._buffer_transport = Transport(group)  # its own meter: buffer bytes apart
        self.aggregator = make_aggregator(self.config, self.transport.world_size)
        self.compensation = _make_compensation(self.config)
        bucket_numel = max(1, int(self.config.bucket_mb * 2**20 / 4))
        state_device = self._state_device()
        with torch.no_grad():
            for i, names in enumerate(self.fragment_names):
                params = [_local(self._by_name[n], self._part) for n in names]
                flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
                # every worker starts from rank 0's parameters (control traffic, not training)
                self.transport.broadcast(flat, src=0, control=True)
                flat = flat.to(state_device)
                frag = _Fragment(
                    i,
                    list(names),
                    [self._by_name[n] for n in names],
                    flat,
                    _views(flat, params),
                    _buckets(params, bucket_numel),
                    part=self._part,
                )
                if self._continues():
                    frag.snapshot = flat.clone()
                self._frags.append(frag)
                self._load_global(frag)
            self._share_parts(self._frags)
            self._broadcast_constants(floating=True)
            # rank 0's broadcast returns once its bytes are queued; on a slow link a receiver
            # holds the model seconds later. Meet here, so that skew is not waited out (and
            # counted) at the first sync.
            self.transport.all_gather(torch.zeros(1), control=True)
        if self._loaded is not None:
            sd, self._loaded = self._loaded, None
            self._load_run_state(sd)

    def _join_group(self) -> dist.ProcessGroup:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(_NO_GROUP_MESSAGE)
        shutdown_at_exit()
        if self._process_group is not None:
            return self._process_group
        if self._mesh is not None:
            return self._join_mesh()
        # A group of its own, so engine traffic (possibly on the comm thread) never
        # interleaves with the training loop's own collectives on the default group.
        return dist.new_group(
            backend=dist.get_backend(), timeout=timedelta(seconds=self._timeout_s)
        )

    def _join_mesh(self) -> dist.ProcessGroup:
        """The outer group of this rank's position; with DDP inside a worker, also the part
        of every parameter this rank syncs and the worker's own group to share the parts."""
        params = list(self._by_name.values())
        outer, inner = _replica_groups(self._mesh, self._timeout_s)
        n = dist.get_world_size(inner)
        if n > 1 and not any(isinstance(p, DTensor) for p in params):
            _check_replicated(self.model, n)
            self._part = (dist.get_rank(inner), n)
            self._inner = Transport(inner)
        return outer

    def _share_parts(self, frags: list[_Fragment]) -> None:
        """DDP inside a worker: each rank wrote only its part of these fragments' parameters;
        every part is broadcast from its rank to the worker's other ranks (a fast local link)."""
        if self._part is None:
            return
        n = self._part[1]
        with torch.no_grad():
            for f in frags:
                for owner in range(n):
                    pieces = [_local(p, (owner, n)) for p in f.raw]
                    flat = torch.cat([x.reshape(-1) for x in pieces])
                    self._inner.broadcast(flat, src=owner, control=False)
                    for x, v in zip(pieces, _views(flat, pieces)):
                        x.copy_(v)

    def _reenter(self) -> None:
        """Second and later blocks: the model must still hold what leaving published.

        After a block left by an exception nothing was published or kept: training goes on
        from the weights as they are.
        """
        if self._kept_local is None:
            return
        if self._published is not None:
            current = {n: _local(p, self._part) for n, p in self.model.named_parameters()}
            changed = [
                n
                for n, v in self._published.items()
                if not torch.equal(current[n].detach().to(v.device, v.dtype), v)
            ]
            if changed:
                raise ConfigError(
                    f"the model's parameters changed since the last block ended (e.g. "
                    f"{changed[0]}): to continue from a checkpoint load it with "
                    f"sync.load_state_dict(...) instead of model.load_state_dict(...)"
                )
        _load_named(self.model, self._kept_local, self._part)
        self._share_parts(self._frags)
        self._kept_local = None

    def finish(self) -> None:
        """Leave the block: wait for every worker, then load the consolidated model
        (see module doc)."""
        if not self._started:
            return
        self._remove_hook()
        t0, blocked0 = time.perf_counter(), self.transport.meter.blocked_s
        unsent = self._join_peers()
        self._collect_replica_check()
        kept = self._keep_run_state()
        sent0 = self.transport.meter.sent_bytes
        self._drain()
        self._final_outer_step(unsent)
        self._sync_buffers()
        self.stats.final_syncs += 1
        self.stats.final_sync_bytes_sent += self.transport.meter.sent_bytes - sent0
        self._publish()
        self._restore_run_state(kept)
        self.stats.outer_s += (time.perf_counter() - t0) - (
            self.transport.meter.blocked_s - blocked0
        )
        self.close()

    def close(self) -> None:
        """Remove the optimizer hook and stop the comm thread (no final sync: after an error)."""
        self._remove_hook()
        if self.transport is not None:
            self.transport.close()
            self._update_stats()
        self._started = False

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- the outer loop --------------------------------------------------------------------------
    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        self.stats.inner_steps = self.step
        for frag in self._frags:
            frag.unsent += 1
        self._count_compensation_step()
        self.run_due(self.step)

    def _count_compensation_step(self) -> None:
        """Periodic resets of the error buffers are counted in inner optimizer steps."""
        if self.compensation is not None:
            self.compensation.step()
        if self.aggregator is not None and self.aggregator.reduce_compensation is not None:
            self.transport.submit(self.aggregator.step)  # after the exchanges queued before it

    def run_due(self, step: int, joining: bool = False) -> torch.Tensor | None:
        """Do whatever the schedule says is due after inner step ``step`` (see module doc).

        ``joining``: this worker has left its loop and only mirrors its peers' syncs. Returns
        the control flags when that showed every worker has left (nothing was exchanged).
        """
        sends = self.schedule.sends_at(step)
        due = [p for p, pend in self._pending.items() if pend.apply_at <= step or p in sends]
        if not sends and (joining or not due):
            # a worker that has left mirrors collectives only: results due are applied by the
            # next sync or the drain, so a run that re-enters applies them at the same step
            return None
        assert self.transport is not None
        t0, blocked0 = time.perf_counter(), self.transport.meter.blocked_s
        self._collect_replica_check()
        flags = None
        if sends and joining:
            flags = self.transport.blocking(self._flags_job(self._flags(step, done=True)))
            if bool((flags[:, _DONE] == 1).all()):
                return flags  # every worker has left: stop before exchanging anything
        results = {p: self._take(p) for p in sorted(due)}
        if sends:
            self._send(sends, step, flags, results)
        with torch.no_grad():
            for p in sorted(results):
                self._apply(p, *results[p])
            self._after_sends(sends, results)
        self.last_sync_step = step
        if sends:
            self._count_sync(len(sends))
        spent = (time.perf_counter() - t0) - (self.transport.meter.blocked_s - blocked0)
        self.stats.outer_s += spent
        self.sync_times.caller += spent
        self._update_stats()
        return None

    def _take(self, p: int) -> tuple[Reduced, torch.Tensor | None, _Event]:
        pend = self._pending.pop(p)
        event = self.transport.wait(pend.future)
        self.events.append(("applied", p, time.perf_counter()))
        return event.reduced[p], pend.own, event

    def _send(
        self,
        sends: list[int],
        step: int,
        flags: torch.Tensor | None,
        results: dict[int, tuple[Reduced, torch.Tensor | None, _Event]],
    ) -> None:
        """Encode the fragments due and start (or run) their exchange."""
        encoded, owns, nonfinite = {}, {}, False
        t0 = time.perf_counter()
        for p in sends:
            encoded[p], owns[p], bad = self._encode(self._frags[p])
            nonfinite |= bad
        self.sync_times.encode += time.perf_counter() - t0
        mine = None if flags is not None else self._flags(step, done=False, nonfinite=nonfinite)
        job = self._event_job(encoded, mine, flags)
        if self.schedule.overlap == 0:
            event = self.transport.blocking(job)
            results.update({p: (event.reduced[p], owns[p], event) for p in sends})
        else:
            future = self.transport.submit(job)
            apply_at = self.schedule.apply_step(step)
            for p in sends:
                self._pending[p] = _Pending(future, step, apply_at, owns[p])
        for p in sends:
            self.events.append(("sent", p, time.perf_counter()))

    def _after_sends(self, sends: list[int], results: dict) -> None:
        """CO2's round 0 has no stale average to apply (theta_1 = theta_0), but its merge rule
        runs all the same: reset restarts from theta_0, continue keeps co2_keep of what it sent."""
        if not self.schedule.is_round_overlap():
            return
        first = [self._frags[p] for p in sends if p not in results]
        for frag in first:
            self._merge(frag)
        self._share_parts(first)

    def _count_sync(self, n_fragments: int) -> None:
        self.stats.syncs += 1
        self.stats.fragment_syncs += n_fragments
        every = self.config.replica_check_every
        if every and self.stats.syncs % every == 0:
            self._start_replica_check()

    def _flags(self, step: int, done: bool, nonfinite: bool = False) -> torch.Tensor:
        row = [int(done), step, int(nonfinite)] + [f.unsent for f in self._frags]
        return torch.tensor(row, dtype=torch.int64)

    def _flags_job(self, mine: torch.Tensor) -> Callable[[], torch.Tensor]:
        transport = self.transport
        assert transport is not None
        return lambda: torch.stack(transport.all_gather(mine, control=True))

    def _encode(self, frag: _Fragment) -> tuple[list[Encoded], torch.Tensor | None, bool]:
        """One fragment's pseudo-gradient, compensated and encoded per bucket.

        Returns the payloads, what this worker sent decoded (for the continue merge) and
        whether its update was non-finite. A fragment without inner steps since its last send
        (a worker that has left its loop) is not contributed; a non-finite one is left out:
        peers average without it and its error buffer is not polluted.
        """
        assert self.aggregator is not None
        reference = frag.snapshot if frag.snapshot is not None else frag.global_flat
        pseudo_grad = _minus_params(reference, frag.params)
        contributes = frag.unsent > 0
        nonfinite = contributes and not _all_finite(pseudo_grad)
        if nonfinite:
            self._left_out.add(frag.index)
            self.stats.left_out_here += 1
            log.warning(
                "rank %d: non-finite pseudo-gradient in fragment %d at step %d; left out "
                "of this sync, restarting from the global parameters",
                self.transport.rank,
                frag.index,
                self.step,
            )
        valid = contributes and not nonfinite
        encoded = self._encode_buckets(frag, pseudo_grad, valid, need_own=frag.snapshot is not None)
        own = None
        if frag.snapshot is not None:
            own = (  # cat copies: own never aliases a payload
                torch.cat([e.local for e in encoded])
                if valid  # type: ignore[misc]
                else torch.zeros_like(pseudo_grad)
            )
            for s, p in zip(_views(frag.snapshot, frag.params), frag.params):
                s.copy_(p.detach())  # the local weights, in FP32
        frag.unsent = 0
        return encoded, own, nonfinite

    def _encode_buckets(
        self, frag: _Fragment, pseudo_grad: torch.Tensor, valid: bool, need_own: bool
    ) -> list[Encoded]:
        """Encode per bucket, through the error compensation when there is one (error feedback:
        e <- beta e + delta, send e, e <- e - sent; LoCo: h = delta + e, e <- moving average of
        h - sent). The key names each bucket's buffer for a compensated two-phase reduce."""
        views = _views(pseudo_grad, frag.params)
        encoded = []
        for b, bucket in enumerate(frag.buckets):
            names, tensors = [frag.names[i] for i in bucket], [views[i] for i in bucket]
            key = f"fragment {frag.index} bucket {b}"
            if self.compensation is None:
                encoded.append(
                    self.aggregator.encode(tensors, need_local=need_own, valid=valid, key=key)
                )
            else:
                encoded.append(
                    encode_compensated(
                        self.aggregator, self.compensation, names, tensors, valid, key=key
                    )
                )
        return encoded

    def _event_job(
        self,
        encoded: dict[int, list[Encoded]],
        mine: torch.Tensor | None,
        flags: torch.Tensor | None,
        with_buffers: bool = True,
    ) -> Callable[[], _Event]:
        """The collectives of one sync: control flags (unless given), each fragment's exchange,
        then the floating buffers."""
        aggregator, transport, stats, events, times = (
            self.aggregator,
            self.transport,
            self.stats,
            self.events,
            self.sync_times,
        )
        assert aggregator is not None and transport is not None
        buffers = None
        if with_buffers and self.config.buffers != "local":
            buffers = _buffers.float_flat(self.model)

        def job() -> _Event:
            t0, collective0, exchanging = time.perf_counter(), aggregator.collective_s, 0.0
            gathered = (
                flags if mine is None else torch.stack(transport.all_gather(mine, control=True))
            )
            sent0 = transport.meter.sent_bytes
            reduced = {}
            for p, parts in encoded.items():
                t1 = time.perf_counter()
                out = [aggregator.exchange(e, transport) for e in parts]
                exchanging += time.perf_counter() - t1
                reduced[p] = (
                    out[0]
                    if len(out) == 1
                    else Reduced(
                        torch.cat([r.mean for r in out]), min(r.valid_workers for r in out)
                    )
                )
                events.append(("completed", p, time.perf_counter()))
            stats.peak_bytes_per_sync = max(
                stats.peak_bytes_per_sync, transport.meter.sent_bytes - sent0
            )
            event = _Event(gathered, reduced, self._exchange_buffers(buffers))
            # what exchange() spent outside its collectives is decoding and summing
            decoding = exchanging - (aggregator.collective_s - collective0)
            elapsed = time.perf_counter() - t0
            times.decode_sum += decoding
            times.collective += elapsed - decoding
            times.exchange += elapsed
            return event

        return job

    def _exchange_buffers(self, flat: torch.Tensor | None) -> torch.Tensor | None:
        """Floating buffers averaged in FP32 (``average``) or rank 0's (``broadcast``)."""
        if flat is None or flat.numel() == 0:
            return None
        bt = self._buffer_transport
        assert bt is not None
        if self.config.buffers == "broadcast":
            return bt.broadcast(flat, src=0, control=False)
        return bt.all_reduce(flat).div_(bt.world_size)

    # -- applying results ------------------------------------------------------------------------
    def _apply(
        self, p: int, reduced: Reduced, own: torch.Tensor | None, event: _Event, final: bool = False
    ) -> None:
        """Outer step on fragment p's global copy, then merge it into the local parameters."""
        frag = self._frags[p]
        if not final:
            self._track_nonfinite(p, event)
        t0 = time.perf_counter()
        if reduced.valid_workers > 0:
            self.outer.step(frag.key, frag.global_flat, reduced.mean.to(frag.global_flat.device))
        t1 = time.perf_counter()
        self.sync_times.outer += t1 - t0
        if p in self._left_out and not final:
            # this worker diverged: restart the fragment from the global copy, with fresh
            # inner optimizer state (its moments may hold the same NaN/Inf)
            self._left_out.discard(p)
            self._load_global(frag)
            if frag.snapshot is not None:
                frag.snapshot.copy_(frag.global_flat)
            for param in frag.raw:
                self.inner_optimizer.state.pop(param, None)
        else:
            self._merge(frag)
        self._share_parts([frag])
        if event.buffers is not None and not final:
            _buffers.load_float_flat(self.model, event.buffers)
        self.sync_times.merge += time.perf_counter() - t1

    def _track_nonfinite(self, p: int, event: _Event) -> None:
        bad = event.nonfinite_workers
        if bad == 0:
            self._nonfinite_streak = 0
            return
        m = self.transport.world_size
        self.stats.left_out_syncs += 1
        self._nonfinite_streak += 1
        log.warning(
            "step %d: %d of %d workers left out of fragment %d's sync (non-finite "
            "pseudo-gradient); %d such syncs in a row",
            self.step,
            bad,
            m,
            p,
            self._nonfinite_streak,
        )
        if self._nonfinite_streak >= self.config.nonfinite_patience:
            raise NonFiniteError(
                f"{self._nonfinite_streak} syncs in a row had non-finite pseudo-gradients "
                f"(last at inner step {self.step}): lower inner_lr, check the data, or resume "
                f"from the last checkpoint; nonfinite_patience={self.config.nonfinite_patience}"
            )

    def _merge(self, frag: _Fragment) -> None:
        """The new global copy into the local weights, by the configured merge rule."""
        if frag.snapshot is not None:
            self._merge_continue(frag)
            return
        alpha = self.config.alpha if self.schedule.overlap > 0 else 0.0
        if alpha == 0.0:
            self._load_global(frag)
            return
        for p, g in zip(frag.params, frag.global_views):
            p.mul_(alpha).add_(g.to(p.device, p.dtype), alpha=1.0 - alpha)

    def _merge_continue(self, frag: _Fragment) -> None:
        """theta <- global - kappa * (own send in flight) - (progress since the last send).

        The invariant: a worker's weights are the global copy minus its own progress that the
        global copy does not hold yet (the part of its send in flight it keeps: kappa, CO2's
        co2_keep, else 1). CO2 (tau = H): right after round r is sent this is
        theta_{r+1} - kappa * delta_r; a drain at the end gives theta - (the partial round).
        """
        assert frag.snapshot is not None
        # the same arithmetic as snapshot - local etc., written into two buffers, not five
        progress = _minus_params(frag.snapshot, frag.params)
        pend = self._pending.get(frag.index)
        in_flight = pend.own if pend is not None and pend.own is not None else 0.0
        new_local = torch.sub(frag.global_flat, in_flight, alpha=self._own_weight()).sub_(progress)
        torch.add(new_local, progress, out=frag.snapshot)
        for p, v in zip(frag.params, _views(new_local, frag.params)):
            p.copy_(v)

    # -- leaving the block -----------------------------------------------------------------------
    def _join_peers(self) -> list[int]:
        """Mirror the peers' remaining syncs until every worker has left; unsent steps per fragment.

        A worker that is done contributes its unsent progress at the next sync of each fragment
        and then takes part without contributing, so uneven step counts never hang.
        """
        step = self.step
        while True:
            step += 1
            flags = self.run_due(step, joining=True)
            if flags is not None:
                return flags[:, _UNSENT:].max(dim=0).values.tolist()

    def _drain(self) -> None:
        for p in sorted(self._pending):
            reduced, own, event = self._take(p)
            with torch.no_grad():
                self._apply(p, reduced, own, event, final=True)

    def _final_outer_step(self, unsent: list[int]) -> None:
        """One blocking outer step for each fragment some worker has unsent inner steps in."""
        todo = [p for p, n in enumerate(unsent) if n > 0]
        if not todo:
            return
        encoded = {}
        for p in todo:
            encoded[p], _, _ = self._encode(self._frags[p])
            self.events.append(("sent", p, time.perf_counter()))
        flags = self._flags(self.step, done=True).unsqueeze(0)  # everyone is here: no gather
        event = self.transport.blocking(self._event_job(encoded, None, flags, with_buffers=False))
        with torch.no_grad():
            for p in todo:
                reduced = event.reduced[p]
                if reduced.valid_workers > 0:
                    frag = self._frags[p]
                    self.outer.step(
                        frag.key, frag.global_flat, reduced.mean.to(frag.global_flat.device)
                    )
                self.events.append(("applied", p, time.perf_counter()))

    def _sync_buffers(self) -> None:
        """Leaving: floating buffers averaged (or rank 0's), integer ones and frozen weights
        rank 0's."""
        self._broadcast_constants(floating=self.config.buffers == "broadcast")
        if self.config.buffers == "average":
            flat = self._exchange_buffers(_buffers.float_flat(self.model))
            if flat is not None:
                _buffers.load_float_flat(self.model, flat)

    def _broadcast_constants(self, floating: bool) -> None:
        """Frozen parameters and integer buffers (floating ones too if asked) from rank 0."""
        tensors = list(self._frozen)
        if self.config.buffers != "local":
            tensors += _buffers.persistent(self.model, floating=None if floating else False)
        with torch.no_grad():
            for t in tensors:
                self.transport.broadcast(_local(t).data, src=0, control=True)

    def _publish(self) -> None:
        with torch.no_grad():
            for frag in self._frags:
                self._load_global(frag)
        self._share_parts(self._frags)
        self._published = {
            n: v.detach().clone() for f in self._frags for n, v in zip(f.names, f.global_views)
        }

    def _keep_run_state(self) -> dict[str, Any]:
        """What leaving must not change: local weights and buffers, global copies, outer state."""
        kept = {
            "local": _named_state(self.model, self._part),
            "global": [f.global_flat.clone() for f in self._frags],
            "snapshot": [None if f.snapshot is None else f.snapshot.clone() for f in self._frags],
            "unsent": [f.unsent for f in self._frags],
            "outer": self.outer.state_dict(),
            "compensation": self.compensation.state_dict()
            if self.compensation is not None
            else None,
            "reduce_compensation": self._reduce_compensation_state(),
            "pending": dict(self._pending),
            "left_out": set(self._left_out),  # a non-finite final step must not mark the run
        }
        return kept

    def _reduce_compensation_state(self) -> dict[str, Any]:
        comp = self.aggregator.reduce_compensation if self.aggregator is not None else None
        if comp is None:
            return {}
        self.transport.wait(
            self.transport.submit(lambda: None)
        )  # its updates run on the comm thread
        return comp.state_dict()

    def _load_reduce_compensation(self, state: dict[str, Any] | None) -> None:
        comp = self.aggregator.reduce_compensation if self.aggregator is not None else None
        if comp is not None and state:
            comp.load_state_dict(state)

    def _restore_run_state(self, kept: dict[str, Any]) -> None:
        for f, g, s, n in zip(self._frags, kept["global"], kept["snapshot"], kept["unsent"]):
            f.global_flat.copy_(g)
            if s is not None:
                f.snapshot.copy_(s)
            f.unsent = n
        self.outer.load_state_dict(kept["outer"])
        if kept["compensation"] is not None:
            self.compensation.load_state_dict(kept["compensation"])
        self._load_reduce_compensation(kept["reduce_compensation"])
        self._pending = kept["pending"]
        self._left_out = kept["left_out"]
        self._kept_local = kept["local"]

    # -- replica check ---------------------------------------------------------------------------
    def _start_replica_check(self) -> None:
        """Hash the global copy now; gather every worker's hash on the comm thread
        (checked later)."""
        digest = hashlib.sha256()
        for f in self._frags:
            digest.update(f.global_flat.detach().cpu().contiguous().numpy().tobytes())
        mine = torch.tensor([int.from_bytes(digest.digest()[:8], "little", signed=True)])
        transport = self.transport
        # queued behind any exchange in flight, so it never stalls the overlap
        self._replica_check = transport.submit(lambda: transport.all_gather(mine, control=True))

    def _collect_replica_check(self) -> None:
        if self._replica_check is None:
            return
        hashes = [int(h) for h in self.transport.wait(self._replica_check)]
        self._replica_check = None
        self.stats.replica_checks += 1
        bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if bad:
            raise ReplicaMismatchError(
                f"global parameters differ between workers (ranks {bad} disagree with rank 0 after "
                f"sync {self.stats.syncs}): the replicas diverged; resume from the last checkpoint"
            )

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything this worker needs to continue identically: save it on every rank.

        Tensors and plain types only. Local weights are included; results still in flight are
        awaited and stored as pending, not applied early, so a resumed run applies them at the
        same step as an uninterrupted one would.
        """
        if not self._frags:
            raise ConfigError("state_dict() needs a started run: enter the with block first")
        self._collect_replica_check()
        self._update_stats()
        local = (
            self._kept_local
            if self._kept_local is not None
            else _named_state(self.model, self._part)
        )
        return {
            "step": self.step,
            "fragments": [list(f.names) for f in self._frags],
            "global": {f.key: f.global_flat.clone() for f in self._frags},
            "snapshot": {f.key: f.snapshot.clone() for f in self._frags if f.snapshot is not None},
            "unsent": [f.unsent for f in self._frags],
            "local": {k: v.clone() for k, v in local.items()},
            "outer": self.outer.state_dict(),
            "compensation": self.compensation.state_dict() if self.compensation is not None else {},
            "reduce_compensation": self._reduce_compensation_state(),
            "pending": self._pending_state(),
            "left_out": sorted(self._left_out),
            "nonfinite_streak": self._nonfinite_streak,
            "stats": {k: v for k, v in self.stats.as_dict().items() if k != "extra"},
            "meter": self.transport.meter.as_dict(),
        }

    def _pending_state(self) -> dict[str, Any]:
        out = {}
        for p in sorted(self._pending):
            pend = self._pending[p]
            event = self.transport.wait(pend.future)
            done: Future = Future()
            done.set_result(event)
            self._pending[p] = dataclasses.replace(pend, future=done)
            red = event.reduced[p]
            out[str(p)] = {
                "mean": red.mean.clone(),
                "valid_workers": red.valid_workers,
                "flags": event.flags.clone(),
                "buffers": event.buffers,
                "own": pend.own,
                "sent_at": pend.sent_at,
                "apply_at": pend.apply_at,
            }
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue a run saved with ``state_dict()`` (this rank's file).

        Before the block: applied when it starts (after the start-up broadcast). Inside or
        between blocks: applied now. ``local=None`` (a resume on another number of workers)
        starts every worker from the global copy.
        """
        if not self._frags:
            self._loaded = sd
            return
        self._load_run_state(sd)

    def _load_run_state(self, sd: dict[str, Any]) -> None:
        if sd["fragments"] != [list(f.names) for f in self._frags]:
            raise ConfigError(
                "the checkpoint's fragments differ from this run's: resume with the "
                "same model and fragment settings"
            )
        snaps = sd.get("snapshot") or {}
        unsent = sd.get("unsent") or [0] * len(self._frags)
        with torch.no_grad():
            for f, n in zip(self._frags, unsent):
                f.global_flat.copy_(sd["global"][f.key])
                if f.snapshot is not None:
                    f.snapshot.copy_(snaps.get(f.key, sd["global"][f.key]))
                f.unsent = int(n)
        self.outer.load_state_dict(sd["outer"])
        if self.compensation is not None and sd["compensation"]:
            self.compensation.load_state_dict(sd["compensation"])
        self._load_reduce_compensation(sd.get("reduce_compensation"))
        self.step = int(sd["step"])
        self._pending = {int(p): _pending_from(int(p), d) for p, d in sd["pending"].items()}
        self._left_out = set(sd["left_out"])
        self._nonfinite_streak = int(sd["nonfinite_streak"])
        for k, v in sd["stats"].items():
            setattr(self.stats, k, v)
        self.transport.meter.load_dict(sd.get("meter", {}))  # byte and time totals continue
        self._load_local(sd.get("local"), now=self._started or self._kept_local is None)

    def _load_local(self, local: dict[str, torch.Tensor] | None, now: bool) -> None:
        """The saved local weights into the model (``now``), or kept for the next block."""
        if local is None:
            with torch.no_grad():
                for f in self._frags:
                    self._load_global(f)
            local = _named_state(self.model, self._part)
        if now:
            _load_named(self.model, local, self._part)
            self._share_parts(self._frags)
        else:  # between blocks: the next start() restores these instead of the kept ones
            self._kept_local, self._published = dict(local), None

    @staticmethod
    def _load_global(frag: _Fragment) -> None:
        for p, g in zip(frag.params, frag.global_views):
            p.copy_(g)

    def _own_weight(self) -> float:
        """How much of its own in-flight send a worker keeps: CO2's co2_keep, else all of it."""
        return self.config.co2_keep if self.schedule.is_round_overlap() else 1.0

    def _continues(self) -> bool:
        """Whether results merge by the continue rule (needs a snapshot per fragment)."""
        if self.schedule.is_round_overlap():
            return self.config.co2_merge == "continue"
        return self.schedule.overlap > 0 and self.config.merge == "continue"

    # -- inspection ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def global_parameters(self) -> Iterator[nn.Module]:
        """Temporarily load the global parameters into the model (e.g. to evaluate theta_global).

        Outside the block the model already holds the published (consolidated) model.
        """
        if not self._started:
            yield self.model
            return
        saved = [p.detach().clone() for f in self._frags for p in f.params]
        with torch.no_grad():
            for f in self._frags:
                self._load_global(f)
        self._share_parts(self._frags)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip((p for f in self._frags for p in f.params), saved):
                    p.copy_(s)
            self._share_parts(self._frags)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global parameters by name: the run's global copy inside the block, the
        consolidated model that leaving loaded into every worker outside it."""
        if not self._started and self._published is not None:
            return dict(self._published)
        return {n: v for f in self._frags for n, v in zip(f.names, f.global_views)}

    def global_flat(self) -> torch.Tensor:
        """All global parameters (as :meth:`global_state`) as one flat FP32 tensor,
        fragment order."""
        state = self.global_state()
        return torch.cat([state[n].reshape(-1).float() for f in self._frags for n in f.names])

    def _update_stats(self) -> None:
        if self.transport is None:
            return
        m = self.transport.meter
        s = self.stats
        s.payload_bytes, s.bytes_sent, s.bytes_received = (
            m.payload_bytes,
            m.sent_bytes,
            m.received_bytes,
        )
        s.control_bytes_sent, s.control_bytes_received = (
            m.control_sent_bytes,
            m.control_received_bytes,
        )
        s.blocked_s = m.blocked_s
        s.extra["sync_times_s"] = dataclasses.asdict(self.sync_times)
        if self._inner is not None:  # DDP inside a worker: parts shared with its ranks
            s.extra["inner_bytes_sent"] = self._inner.meter.sent_bytes
        if self._buffer_transport is not None:
            bm = self._buffer_transport.meter
            s.buffer_bytes_sent, s.buffer_bytes_received = bm.sent_bytes, bm.received_bytes

    def _state_device(self) -> torch.device:
        if self.config.state_device == "model":
            return next(iter(self._by_name.values())).device
        return torch.device(self.config.state_device)


_NO_GROUP_MESSAGE = (
    "lowcomm needs a torch.distributed process group: call "
    "torch.distributed.init_process_group('gloo') (or 'nccl' on GPUs) before entering the block; "
    "torchrun only sets the environment it reads"
)


def _check_arguments(model: Any, opt: Any, config: Any, timeout_s: Any, overrides: dict) -> None:
    """One-line ConfigErrors for arguments of the wrong kind, before anything is built."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"inner_optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    if config is not None and not isinstance(config, SyncConfig):
        raise ConfigError(f"config must be a lowcomm.SyncConfig, got {type(config).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ConfigError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    known = {f.name for f in dataclasses.fields(SyncConfig)}
    bad = [k for k in overrides if k not in known]
    if bad:
        raise ConfigError(
            f"unknown sync option(s) {', '.join(bad)}: see lowcomm.SyncConfig for the knobs"
        )
    if "fragments" in overrides and not isinstance(overrides["fragments"], int):
        raise ConfigError(
            "fragments is a count of fragments; give explicit lists of module names "
            "as fragment_modules=[[...], ...]"
        )


def _check_mesh(mesh: Any, process_group: Any) -> None:
    """A DeviceMesh whose workers lie along a "replicate" dimension, or one clear error."""
    if mesh is None:
        return
    if process_group is not None:
        raise ConfigError("give either mesh= or process_group=, not both")
    names = getattr(mesh, "mesh_dim_names", None)
    if not hasattr(mesh, "mesh") or (mesh.ndim > 1 and "replicate" not in (names or ())):
        raise ConfigError(
            "mesh must be a torch DeviceMesh whose workers lie along a dimension named "
            "'replicate', e.g. init_device_mesh('cpu', (workers, ranks_per_worker), "
            "mesh_dim_names=('replicate', 'shard'))"
        )


def _check_replicated(model: nn.Module, per_worker: int) -> None:
    """Several ranks per worker with unsharded weights must be DDP inside the worker."""
    if not any(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise ConfigError(
            f"mesh= puts {per_worker} ranks in each worker but the model is neither sharded "
            f"with FSDP2 (fully_shard(model, mesh=mesh['shard'])) nor wrapped in "
            f"DistributedDataParallel over the worker's ranks: wrap it, and pass the wrapped "
            f"model, or give one rank per worker"
        )


def _workers_of(mesh: Any) -> int:
    if mesh.ndim == 1:
        return mesh.size()
    return mesh.size(mesh.mesh_dim_names.index("replicate"))


def _replica_groups(mesh: Any, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's outer group (the ranks at its own position in every worker) and its
    worker's group (the ranks of its worker).

    Groups of our own (every rank creates all of them, in one order), so engine traffic never
    interleaves with the user's own collectives on the mesh's groups.
    """
    ranks = mesh.mesh
    if ranks.ndim > 1:
        ranks = ranks.movedim(mesh.mesh_dim_names.index("replicate"), 0)
    ranks = ranks.reshape(ranks.shape[0], -1)  # [worker, position]
    kw = {"backend": dist.get_backend(), "timeout": timedelta(seconds=timeout_s)}
    outer, _ = dist.new_subgroups_by_enumeration([c.tolist() for c in ranks.T], **kw)
    inner, _ = dist.new_subgroups_by_enumeration([r.tolist() for r in ranks], **kw)
    return outer, inner


def _check_optimizer_holds(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    if not any(id(p) in held for p in params):
        raise ConfigError(
            "the inner optimizer holds none of the model's trainable parameters: "
            "build it from this model's parameters (e.g. AdamW(model.parameters()))"
        )


def _pending_from(p: int, d: dict[str, Any]) -> _Pending:
    fut: Future = Future()
    flags = d.get("flags")
    if flags is None:  # checkpoints written before the control flags existed
        flags = torch.zeros((1, _UNSENT), dtype=torch.int64)
    reduced = Reduced(d["mean"], int(d["valid_workers"]))
    fut.set_result(_Event(flags, {p: reduced}, d.get("buffers")))
    return _Pending(fut, int(d["sent_at"]), int(d["apply_at"]), d.get("own"))


def _local(t: torch.Tensor, part: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's part of ``t`` (same storage): a DTensor's local shard; with DDP inside a
    worker (``part`` = (i, n)) the i-th of n slices of its rows; else ``t`` itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # a plain view of the shard, outside autograd
            return t.to_local()
    if part is None:
        return t
    flat = t.detach()
    flat = flat.reshape(1) if flat.dim() == 0 else flat
    return flat.tensor_split(part[1], dim=0)[part[0]]


def _minus_params(reference: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``reference`` minus the params (flat, FP32, on its device) in one pass, without first
    copying the params into a flat buffer."""
    out = torch.empty_like(reference)
    for o, r, p in zip(_views(out, params), _views(reference, params), params):
        torch.sub(r, p.detach().to(reference.device, torch.float32), out=o)
    return out


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: exactly when its min and max are (NaN propagates).

    One read pass; ``isfinite(t).all()`` writes a model-sized mask first (5x a copy on a CPU).
    """
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _named_state(model: nn.Module, part: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Clones of (this rank's part of) the trainable parameters and persistent buffers."""
    out = {
        n: _local(p, part).detach().clone() for n, p in model.named_parameters() if p.requires_grad
    }
    out.update({n: b.detach().clone() for n, b in _buffers.named_persistent(model)})
    return out


def _load_named(
    model: nn.Module, values: dict[str, torch.Tensor], part: tuple[int, int] | None
) -> None:
    targets = {n: _local(p, part) for n, p in model.named_parameters()}
    targets.update(dict(_buffers.named_persistent(model)))
    with torch.no_grad():
        for name, value in values.items():
            targets[name].copy_(value)


def _views(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def _buckets(params: list[nn.Parameter], bucket_numel: int) -> list[list[int]]:
    """Consecutive parameter indices grouped so each group stays under ``bucket_numel``."""
    out: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if out[-1] and size + p.numel() > bucket_numel:
            out.append([])
            size = 0
        out[-1].append(i)
        size += p.numel()
    return out


def _make_compensation(cfg: SyncConfig) -> Any:
    if cfg.compensation == "none":
        return None
    from .compensation import ErrorFeedback, MovingAverageCompensation

    device = cfg.state_device if cfg.state_device != "model" else "cpu"
    if cfg.compensation == "ef":
        return ErrorFeedback(cfg.error_decay, device=device)
    return MovingAverageCompensation(cfg.loco_beta, device=device, reset_every=cfg.loco_reset_every)
