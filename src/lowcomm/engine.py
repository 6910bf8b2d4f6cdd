"""The one outer loop. DiLoCo, Streaming DiLoCo, SparseLoCo and CO2 are configurations of it.

After every inner ``optimizer.step()`` the engine asks the schedule what is due at this global
step and, in this order:

1. waits for the in-flight results that are due now (so at most one exchange per fragment is
   in flight: CO2 waits for round r-1's all-reduce before it starts round r's);
2. for each fragment due to be sent: pseudo_grad = theta_global - theta_local, optional error
   compensation, encode, and start the exchange (blocking when overlap tau = 0, else on the
   transport's comm thread while training continues);
3. applies each result: outer optimizer step on the fragment's global copy, then merge into
   the local parameters, theta <- alpha*theta + (1-alpha)*theta_global (alpha = 0 when tau = 0);
4. with CO2's whole-round overlap (tau = H, one fragment), a fragment that was just sent always
   restarts from the global copy, even in round 0 when there was no stale result to apply.

At the end (``finish``, or leaving the ``with`` block) everything in flight is awaited and
applied, and the model is loaded with the global parameters, so every worker holds one model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .aggregate import Aggregator, Encoded, Reduced, make_aggregator
from .config import ConfigError, SyncConfig
from .outer import OuterOptimizer, make_outer
from .schedule import Schedule, build_fragments, check_fragments, find_blocks
from .transport import Transport


log = logging.getLogger("lowcomm")


from .errors import NonFiniteError, ReplicaMismatchError  # noqa: E402,F401


@dataclass
class _Fragment:
    """One group of parameters synced together, with its global copy as one flat FP32 buffer."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    global_flat: torch.Tensor
    global_views: list[torch.Tensor]
    buckets: list[list[int]]

    @property
    def key(self) -> str:
        return f"fragment{self.index}"


@dataclass
class _Pending:
    future: Future
    sent_at: int
    apply_at: int


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
    blocked_s: float = 0.0
    outer_s: float = 0.0
    peak_bytes_per_sync: int = 0
    left_out_syncs: int = 0         # fragment syncs in which some worker was left out
    left_out_here: int = 0          # ... of which this worker was the one left out
    replica_checks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (for summaries)."""
        return dataclasses.asdict(self)


class LowComm:
    """Low-communication training around an existing (model, inner optimizer) pair.

    Use as a context manager; it hooks ``inner_optimizer.step()`` so the training loop stays
    unchanged::

        sync = lowcomm.DiLoCo(model, opt, sync_every=50)
        with sync:
            for x, y in batches:
                model(x, y).backward(); opt.step(); opt.zero_grad()
        print(sync.stats)

    ``fragments`` may list parameter names per fragment explicitly; otherwise they come from
    the model's block list and ``config.fragments`` / ``blocks_per_fragment``.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 config: SyncConfig | None = None, *, fragments: list[list[str]] | None = None,
                 process_group: dist.ProcessGroup | None = None, timeout_s: float = 300.0,
                 comm_delay_s: float = 0.0, **overrides: Any) -> None:
        bad = [k for k in overrides if k not in {f.name for f in dataclasses.fields(SyncConfig)}]
        if bad:
            raise ConfigError(f"unknown sync option(s) {bad}: see lowcomm.SyncConfig for the knobs")
        self.config = dataclasses.replace(config or SyncConfig(), **overrides).validate()
        self.model = model
        self.inner_optimizer = inner_optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters")
        names = [n for n, _ in named]
        cfg = self.config
        if fragments is None:
            fragments = build_fragments(names, find_blocks(model), cfg.fragments,
                                        cfg.blocks_per_fragment, cfg.fragment_pattern)
        check_fragments(fragments, names)
        cfg.check_schedule(len(fragments))
        self.fragment_names = fragments
        self.schedule = Schedule(cfg.sync_every, len(fragments), cfg.tau)
        self._by_name = dict(named)
        self._process_group = process_group
        self._timeout_s = timeout_s
        self._comm_delay_s = comm_delay_s
        self._frags: list[_Fragment] = []
        self._pending: dict[int, _Pending] = {}
        self._hook: Any = None
        self.step = 0
        self.last_sync_step = -1   # the last step at which anything was sent or applied
        self.stats = SyncStats()
        self.transport: Transport | None = None
        self.aggregator: Aggregator | None = None
        self.outer: OuterOptimizer = make_outer(cfg)
        self.compensation: Any = None
        # (what, fragment, time) for sent / completed / applied: lets tests and users see overlap
        self.events: list[tuple[str, int, float]] = []
        self._left_out: set[int] = set()      # fragments whose last pseudo-gradient here was non-finite
        self._nonfinite_streak = 0
        self._replica_check: Future | None = None
        self._replica_hash = 0
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "LowComm":
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    def start(self) -> None:
        """Join the workers: same initial parameters everywhere, global copies, optimizer hook."""
        if self._started:
            return
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "lowcomm needs torch.distributed initialised: launch with `torchrun` or "
                "`lowcomm train --workers M`, or call torch.distributed.init_process_group first")
        cfg = self.config
        group = self._process_group
        if group is None:
            # A group of its own, so engine traffic (possibly on the comm thread) never
            # interleaves with the training loop's own collectives on the default group.
            group = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=self._timeout_s))
        self.transport = Transport(group, delay_s=self._comm_delay_s)
        self.aggregator = make_aggregator(cfg, self.transport.world_size)
        self.compensation = _make_compensation(cfg)
        state_device = self._state_device()
        bucket_numel = max(1, int(cfg.bucket_mb * 2**20 / 4))
        with torch.no_grad():
            for i, names in enumerate(self.fragment_names):
                params = [self._by_name[n] for n in names]
                flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
                # every worker starts from rank 0's parameters (control traffic, not training)
                self.transport.broadcast(flat, src=0, control=True)
                flat = flat.to(state_device)
                views, offset = [], 0
                for p in params:
                    views.append(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                frag = _Fragment(i, list(names), params, flat, views, _buckets(params, bucket_numel))
                self._frags.append(frag)
                self._load_global(frag)
        self._hook = self.inner_optimizer.register_step_post_hook(self._after_inner_step)
        self._started = True

    def finish(self) -> None:
        """Await and apply everything in flight, then load the global parameters into the model."""
        if not self._started:
            return
        for p in sorted(self._pending):
            pend = self._pending.pop(p)
            self._apply(p, self.transport.wait(pend.future))
        self._collect_replica_check()
        with torch.no_grad():
            for frag in self._frags:
                self._load_global(frag)
        self.close()

    def close(self) -> None:
        """Remove the optimizer hook and stop the comm thread (no final apply)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.transport is not None:
            self.transport.close()
            self._update_stats()
        self._started = False

    # -- the outer loop --------------------------------------------------------------------------
    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        self.stats.inner_steps = self.step
        self.run_due(self.step)

    def run_due(self, step: int) -> None:
        """Do whatever the schedule says is due after inner step ``step`` (see module doc)."""
        sends = self.schedule.sends_at(step)
        due = [p for p, pend in self._pending.items() if pend.apply_at <= step or p in sends]
        if not sends and not due:
            return
        assert self.transport is not None
        t0 = time.perf_counter()
        blocked0 = self.transport.meter.blocked_s
        self._collect_replica_check()
        results: dict[int, Reduced] = {}
        for p in sorted(due):
            pend = self._pending.pop(p)
            results[p] = self.transport.wait(pend.future)
            self.events.append(("applied", p, time.perf_counter()))
        for p in sends:
            encoded = self._encode(self._frags[p])
            job = self._exchange_job(p, encoded)
            if self.schedule.overlap == 0:
                results[p] = self.transport.blocking(job)
            else:
                self._pending[p] = _Pending(self.transport.submit(job), step,
                                            self.schedule.apply_step(step))
            self.events.append(("sent", p, time.perf_counter()))
        with torch.no_grad():
            for p in sorted(results):
                self._apply(p, results[p])
            if self.schedule.is_round_overlap():
                for p in sends:
                    if p not in results:  # CO2 round 0: no stale average yet, theta_1 = theta_0
                        self._merge(self._frags[p])
        self.last_sync_step = step
        if sends:
            self.stats.syncs += 1
            self.stats.fragment_syncs += len(sends)
            every = self.config.replica_check_every
            if every and self.stats.syncs % every == 0:
                self._start_replica_check()
        self.stats.outer_s += (time.perf_counter() - t0) - (self.transport.meter.blocked_s - blocked0)
        self._update_stats()

    def _encode(self, frag: _Fragment) -> list[Encoded]:
        """pseudo_grad = global - local for one fragment, compensated and encoded per bucket.

        A non-finite pseudo-gradient is not sent: this worker is flagged as left out, peers
        average without it, and its error buffer is not polluted.
        """
        assert self.aggregator is not None
        with torch.no_grad():
            local = torch.cat([p.detach().reshape(-1).to(frag.global_flat.device, torch.float32)
                               for p in frag.params])
            pseudo_grad = frag.global_flat - local
            valid = bool(torch.isfinite(pseudo_grad).all())
            if not valid:
                self._left_out.add(frag.index)
                self.stats.left_out_here += 1
                log.warning("rank %d: non-finite pseudo-gradient in fragment %d at step %d; left out "
                            "of this sync, restarting from the global parameters",
                            self.transport.rank, frag.index, self.step)
            views = _views(pseudo_grad, frag.params)
            comp = self.compensation if valid else None
            # error feedback: e <- beta e + delta, send e, e <- e - sent;
            # LoCo: h = delta + e, send h, e <- beta e + (1 - beta)(h - sent)
            to_send = [comp.before_send(n, v) for n, v in zip(frag.names, views)] if comp else views
            encoded = []
            for bucket in frag.buckets:
                enc = self.aggregator.encode([to_send[i] for i in bucket], need_local=comp is not None,
                                             valid=valid)
                if comp is not None:
                    assert enc.local is not None
                    for i, dec in zip(bucket, _views(enc.local, [frag.params[j] for j in bucket])):
                        comp.after_send(frag.names[i], to_send[i], dec)
                encoded.append(enc)
        return encoded

    def _exchange_job(self, p: int, encoded: list[Encoded]):
        aggregator, transport, stats, events = self.aggregator, self.transport, self.stats, self.events
        assert aggregator is not None and transport is not None

        def job() -> Reduced:
            sent0 = transport.meter.sent_bytes
            out = [aggregator.exchange(e, transport) for e in encoded]
            events.append(("completed", p, time.perf_counter()))
            stats.peak_bytes_per_sync = max(stats.peak_bytes_per_sync, transport.meter.sent_bytes - sent0)
            if len(out) == 1:
                return out[0]
            return Reduced(torch.cat([r.mean for r in out]), min(r.valid_workers for r in out))

        return job

    def _apply(self, p: int, reduced: Reduced) -> None:
        """Outer step on fragment p's global copy, then merge it into the local parameters."""
        frag = self._frags[p]
        m = self.transport.world_size
        if reduced.valid_workers < m:
            self.stats.left_out_syncs += 1
            self._nonfinite_streak += 1
            log.warning("step %d: %d of %d workers left out of fragment %d's sync (non-finite "
                        "pseudo-gradient); %d such syncs in a row", self.step, m - reduced.valid_workers,
                        m, p, self._nonfinite_streak)
            if self._nonfinite_streak >= self.config.nonfinite_patience:
                raise NonFiniteError(
                    f"{self._nonfinite_streak} syncs in a row had non-finite pseudo-gradients "
                    f"(last at inner step {self.step}): lower inner_lr, check the data, or resume "
                    f"from the last checkpoint; nonfinite_patience={self.config.nonfinite_patience}")
        else:
            self._nonfinite_streak = 0
        with torch.no_grad():
            if reduced.valid_workers > 0:
                self.outer.step(frag.key, frag.global_flat, reduced.mean.to(frag.global_flat.device))
            if p in self._left_out:
                # this worker diverged: restart the fragment from the global copy, with fresh
                # inner optimizer state (its moments may hold the same NaN/Inf)
                self._left_out.discard(p)
                self._load_global(frag)
                for param in frag.params:
                    self.inner_optimizer.state.pop(param, None)
            else:
                self._merge(frag)

    def _start_replica_check(self) -> None:
        """Hash the global copy now; gather every worker's hash on the comm thread (checked later)."""
        digest = hashlib.sha256()
        for f in self._frags:
            digest.update(f.global_flat.detach().cpu().contiguous().numpy().tobytes())
        self._replica_hash = int.from_bytes(digest.digest()[:8], "little", signed=True)
        transport, mine = self.transport, torch.tensor([self._replica_hash], dtype=torch.int64)
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
                f"sync {self.stats.syncs}): the replicas diverged; resume from the last checkpoint")

    # -- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the engine needs to continue identically (tensors and plain types only).

        Results still in flight are awaited and stored as pending, not applied early, so a
        resumed run applies them at the same step as an uninterrupted one would.
        """
        assert self.transport is not None, "call start() (enter the with block) first"
        pending = {}
        for p in sorted(self._pending):
            pend = self._pending[p]
            red = self.transport.wait(pend.future)
            done: Future = Future()
            done.set_result(red)
            self._pending[p] = _Pending(done, pend.sent_at, pend.apply_at)
            pending[str(p)] = {"mean": red.mean.clone(), "valid_workers": red.valid_workers,
                               "sent_at": pend.sent_at, "apply_at": pend.apply_at}
        self._collect_replica_check()
        self._update_stats()  # the awaited exchanges' bytes are counted now
        return {
            "step": self.step,
            "fragments": [list(f.names) for f in self._frags],
            "global": {f.key: f.global_flat.clone() for f in self._frags},
            "outer": self.outer.state_dict(),
            "compensation": self.compensation.state_dict() if self.compensation is not None else {},
            "pending": pending,
            "left_out": sorted(self._left_out),
            "nonfinite_streak": self._nonfinite_streak,
            "stats": {k: v for k, v in self.stats.as_dict().items() if k != "extra"},
            "meter": self.transport.meter.as_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; call after ``start()``, then load the local model and
        inner optimizer (the engine's start-up broadcast would otherwise overwrite them)."""
        if not self._started:
            raise RuntimeError("load_state_dict needs a started engine: enter the with block first")
        if sd["fragments"] != [list(f.names) for f in self._frags]:
            raise ConfigError("the checkpoint's fragments differ from this run's: resume with the "
                              "same model and fragment settings")
        with torch.no_grad():
            for f in self._frags:
                f.global_flat.copy_(sd["global"][f.key])
        self.outer.load_state_dict(sd["outer"])
        if self.compensation is not None and sd["compensation"]:
            self.compensation.load_state_dict(sd["compensation"])
        self.step = int(sd["step"])
        self._pending = {}
        for p, d in sd["pending"].items():
            fut: Future = Future()
            fut.set_result(Reduced(d["mean"], int(d["valid_workers"])))
            self._pending[int(p)] = _Pending(fut, int(d["sent_at"]), int(d["apply_at"]))
        self._left_out = set(sd["left_out"])
        self._nonfinite_streak = int(sd["nonfinite_streak"])
        for k, v in sd["stats"].items():
            setattr(self.stats, k, v)
        # byte and time totals continue from the checkpoint
        self.transport.meter.load_dict(sd.get("meter", {}))

    def _merge(self, frag: _Fragment) -> None:
        alpha = self.config.alpha if self.schedule.overlap > 0 else 0.0
        if alpha == 0.0:
            self._load_global(frag)
            return
        for p, g in zip(frag.params, frag.global_views):
            p.mul_(alpha).add_(g.to(p.device, p.dtype), alpha=1.0 - alpha)

    @staticmethod
    def _load_global(frag: _Fragment) -> None:
        for p, g in zip(frag.params, frag.global_views):
            p.copy_(g)

    # -- inspection ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def global_parameters(self) -> Iterator[nn.Module]:
        """Temporarily load the global parameters into the model (e.g. to evaluate theta_global)."""
        saved = [p.detach().clone() for f in self._frags for p in f.params]
        with torch.no_grad():
            for f in self._frags:
                self._load_global(f)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, s in zip((p for f in self._frags for p in f.params), saved):
                    p.copy_(s)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global parameters by name (views into the flat global copies)."""
        return {n: v for f in self._frags for n, v in zip(f.names, f.global_views)}

    def global_flat(self) -> torch.Tensor:
        """All global parameters as one flat FP32 tensor (fragment order)."""
        return torch.cat([f.global_flat for f in self._frags])

    def _update_stats(self) -> None:
        if self.transport is None:
            return
        m = self.transport.meter
        s = self.stats
        s.payload_bytes, s.bytes_sent, s.bytes_received = m.payload_bytes, m.sent_bytes, m.received_bytes
        s.control_bytes_sent, s.control_bytes_received = m.control_sent_bytes, m.control_received_bytes
        s.blocked_s = m.blocked_s

    def _state_device(self) -> torch.device:
        if self.config.state_device == "model":
            return next(iter(self._by_name.values())).device
        return torch.device(self.config.state_device)


def _views(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset:offset + p.numel()].view(p.shape))
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
