"""The run object: one worker's training run as named parts, built in two steps.

:func:`set_up` makes the model, optimizer, schedule, data and control transport;
:func:`wrap_for_strategy` adds what the strategy needs: DistributedDataParallel with a metered
comm hook for per-step strategies, the engine (or a peer implementation) for the others.
The training loop itself is in :mod:`lowcomm.train.loop`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ConfigError, TrainConfig
from ..elastic import Elastic
from ..engine import LowComm
from ..engine.state import RunState, StatePart
from ..hooks.ddp import make_ddp_hook
from ..loco import GradReduceState, LoCoState, allreduce_hook, loco_hook
from ..protocols import SyncEngine
from ..transport import ByteMeter, Transport
from . import checkpoint as ckpt
from .build import build_model
from .callbacks import Callbacks
from .data import Batches, load_corpus, val_batches
from .site_role import FIXED_WORLD, ElasticSite, QuorumControl, Role
from .sites import Site, build_mesh, shard_model, site_of
from .spec import RunSpec, site_membership


class Clock:
    """Training time as a sum of timed segments (the inner steps and the final drain).

    Logging, evaluation and checkpoints fall between segments, so they are never counted.
    Each segment splits into compute and the rest — waiting on the network, and the sync's own
    work on the training thread (encode, decode, outer step, merge) — with the rest clamped to
    the segment: ``compute_s <= wall_s`` holds by construction, whatever the meters report.
    Utilization (``compute_s / wall_s``) is defined by this split, once, for every report.
    """

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.compute_s = 0.0
        self.blocked_extra = 0.0
        """Waiting not seen by the engine's meter (the DDP hooks' wait at the end of backward)."""

    @contextlib.contextmanager
    def segment(self, not_computing_s: Callable[[], float]) -> Iterator[list[float]]:
        """Time the block; ``not_computing_s()`` is the total not spent computing (waits and
        sync work), read before and after.

        The block may append extra waiting the meter does not see to the yielded list.
        """
        extra: list[float] = []
        t0, b0 = time.perf_counter(), not_computing_s()
        yield extra
        dt = time.perf_counter() - t0
        waited = min(dt, max(0.0, not_computing_s() - b0 + sum(extra)))
        self.wall_s += dt
        self.compute_s += dt - waited
        self.blocked_extra += sum(extra)

    def state_dict(self) -> dict[str, float]:
        """The totals so far (stored in checkpoints)."""
        return {"wall": self.wall_s, "compute": self.compute_s, "blocked_extra": self.blocked_extra}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue from saved totals."""
        self.wall_s = float(state["wall"])
        self.compute_s = min(float(state["compute"]), self.wall_s)  # older files: clamp too
        self.blocked_extra = float(state["blocked_extra"])


@dataclass
class Place:
    """Where this process runs: device, rank and world, its site (elastic) and replica."""

    device: torch.device
    rank: int
    world: int
    owns_group: bool
    """True when this run created the process group (and so destroys it at the end)."""
    site: Site
    """This rank's replica and place in it (several ranks per worker: FSDP2 inside)."""
    role: Role = FIXED_WORLD
    """A worker of a fixed world, or this process's site in an elastic run."""


@dataclass
class Learner:
    """What trains: the model, what its forward pass runs on, the inner optimizer and schedule."""

    model: nn.Module
    """The bare model: its parameters are the ones the engine syncs and model.pt stores."""
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    vocab_size: int
    train_model: nn.Module | None = None
    """What the forward pass runs on: a DDP wrapper for per-step strategies, else ``model``."""

    def register(self, state: RunState, sharded: bool) -> None:
        """The LR schedule, the model and the inner optimizer; an FSDP2 worker's shards go
        through torch.distributed.checkpoint beside the files (saved and loaded apart)."""
        sched, model, opt = self.sched, self.model, self.opt
        state.register("scheduler", StatePart(sched.state_dict, sched.load_state_dict))
        if sharded:
            state.register("model", StatePart(dict, lambda v: None))
            state.register("optimizer", StatePart(dict, lambda v: None))
            return
        weights = lambda: {k: v.detach().clone() for k, v in model.state_dict().items()}  # noqa: E731
        state.register("model", StatePart(weights, model.load_state_dict))
        state.register("optimizer", StatePart(opt.state_dict, opt.load_state_dict))


@dataclass
class Data:
    """The corpus this rank trains and evaluates on."""

    description: str
    """One line describing the corpus (source, token counts, split)."""
    tokenizer_file: str | None
    """The tokenizer that made the tokens (saved with Hugging Face models); None for bytes."""
    batches: Batches
    val: list[tuple[torch.Tensor, torch.Tensor]]

    def register(self, state: RunState) -> None:
        """Where the batches are (so a resume reads the next ones, not the first)."""
        state.register("data", StatePart(self.batches.state_dict, self.batches.load_state_dict))


@dataclass
class Comm:
    """How this rank communicates: the strategy's engine or DDP hook, and the meters."""

    control: Transport
    """Loss logging and summaries: counted as control traffic."""
    inner_meter: ByteMeter
    """FSDP2's traffic inside the worker (nothing with one rank per worker)."""
    hsdp_meter: ByteMeter | None = None
    """HSDP's all-reduce between workers: the per-step baseline's traffic with FSDP2 inside."""
    engine: SyncEngine | None = None  # LowComm, or a peer library's outer loop
    """LowComm (or a peer with the same surface) for outer-step strategies; None for per-step."""
    hook_state: GradReduceState | None = None
    """The DDP comm hook's state for per-step strategies; None otherwise."""

    def register(self, state: RunState) -> None:
        """The engine's state, a LoCo hook's error buffers, and every meter's totals."""
        engine, hook = self.engine, self.hook_state
        if engine is not None:  # a peer's engine is never checkpointed (refused before start)
            state.register(
                "engine",
                StatePart(lambda: engine.state_dict(), lambda v: engine.load_state_dict(v)),
            )
        else:
            state.register("engine", StatePart(dict, lambda v: None))
        if isinstance(hook, LoCoState):
            state.register("hook", StatePart(hook.state_dict, self._load_hook))
        else:
            state.register("hook", StatePart(dict, lambda v: None))
        state.register("meters", StatePart(self._meters, self._load_meters))

    def _load_hook(self, saved: dict[str, Any]) -> None:
        if saved:  # empty when saved before the hook kept state
            assert isinstance(self.hook_state, LoCoState)
            self.hook_state.load_state_dict(saved)

    def _meters(self) -> dict[str, dict[str, Any]]:
        hook, hsdp = self.hook_state, self.hsdp_meter
        return {
            "hook": hook.transport.meter.as_dict() if hook is not None else {},
            "control": self.control.meter.as_dict(),
            "inner": self.inner_meter.as_dict(),
            "hsdp": hsdp.as_dict() if hsdp is not None else {},
        }

    def _load_meters(self, saved: dict[str, dict[str, Any]]) -> None:
        if self.hook_state is not None:
            self.hook_state.transport.meter.load_dict(saved["hook"])
        self.control.meter.load_dict(saved["control"])
        self.inner_meter.load_dict(saved.get("inner", {}))
        if self.hsdp_meter is not None:
            self.hsdp_meter.load_dict(saved.get("hsdp", {}))

    def blocked_s(self) -> float:
        """The engine meter's total waiting time (HSDP's all-reduce wait with FSDP2 inside a
        worker and no engine; else 0 without an engine)."""
        if self.engine is not None:
            return self.engine.transport.meter.blocked_s
        return self.hsdp_meter.blocked_s if self.hsdp_meter is not None else 0.0

    def not_computing_s(self) -> float:
        """Seconds so far not spent on inner steps: waits on the network, plus the sync's own
        work on the training thread (the engine's encode, decode, outer step and merge; a
        LoCo hook's encode)."""
        if self.engine is not None:
            work = self.engine.stats.outer_s
        else:
            work = getattr(self.hook_state, "work_s", 0.0)
        return self.blocked_s() + work

    def meter_totals(self, blocked_extra: float) -> dict[str, float]:
        """The strategy's meter (engine or hook) plus the control traffic, as one dict;
        ``blocked_extra``: waiting the meters did not see."""
        meter = (
            self.engine.transport.meter
            if self.engine is not None and self.engine.transport is not None
            else self.hook_state.transport.meter
            if self.hook_state is not None
            else self.hsdp_meter
        )
        totals = meter.as_dict() if meter is not None else {}
        for k in ("control_payload_bytes", "control_sent_bytes", "control_received_bytes"):
            totals[k] = totals.get(k, 0) + getattr(self.control.meter, k)
        totals["blocked_s"] = totals.get("blocked_s", 0.0) + blocked_extra
        return totals


@dataclass
class Progress:
    """How far the run is and what it has counted: clocks, losses, pending work."""

    clock: Clock = field(default_factory=Clock)
    start_step: int = 1
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    """The train loss summed since the last record, and the steps summed (on the device)."""
    pending_checkpoint: bool = False
    """A checkpoint is due: taken at the next sync boundary."""
    events_logged: int = 0
    """Membership events already marked in metrics.jsonl."""
    checkpoint_s: float = 0.0
    """Seconds spent writing checkpoints (this rank)."""

    def register(self, state: RunState) -> None:
        """The clock's totals (utilization goes on from where it was)."""
        state.register("clock", StatePart(self.clock.state_dict, self.clock.load_state_dict))


@dataclass
class Run:
    """One worker's run, as named parts: what was asked (``spec``), where it runs (``place``),
    what trains (``learner``), on what (``data``), how it communicates (``comm``), how far it
    is (``progress``)."""

    spec: RunSpec
    place: Place
    learner: Learner
    data: Data
    comm: Comm
    progress: Progress = field(default_factory=Progress)
    state: RunState = field(default_factory=RunState)
    """What a checkpoint holds and a resume loads, registered by the parts that own it
    (:func:`register_state`, once the strategy is attached)."""
    callbacks: Callbacks = field(default_factory=Callbacks)
    """Parts that act around the inner steps and on the engine (none by default)."""

    @property
    def membership(self) -> Any:
        """The engine's membership runner in an elastic run (who is in), else None."""
        engine = self.comm.engine
        return engine.membership if self.place.role.elastic and engine is not None else None

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's files: rank 0, or the lowest live site (every
        site launched on its own: its folder is its own)."""
        if self.place.role.alone:
            return self.place.site.part == 0  # the site's first rank
        members = self.membership.members if self.membership is not None else None
        if isinstance(self.place.role, ElasticSite) and members:
            return members[0] == self.place.role.site
        return self.place.rank == 0

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained per inner step over all workers."""
        return self.spec.train.batch_size * self.spec.train.seq_len * self.place.site.replicas

    def not_computing_s(self) -> float:
        """Seconds so far not spent on inner steps (see :meth:`Comm.not_computing_s`)."""
        return self.comm.not_computing_s()

    def meter_totals(self) -> dict[str, float]:
        """The strategy's meter plus the control traffic and the waits the meters missed."""
        return self.comm.meter_totals(self.progress.clock.blocked_extra)

    def sync_context(self) -> contextlib.AbstractContextManager[Any]:
        """The engine's ``with`` block (start-up broadcast, then hooks), or nothing."""
        engine = self.comm.engine
        return engine if engine is not None else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast on CUDA; nothing on CPU."""
        if self.place.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def evaluate(self) -> float:
        """Mean validation loss on the global parameters; batches split across workers.

        Every rank of a worker runs its worker's batches (FSDP2's forward is collective inside
        a worker); each adds the same losses, so the mean over all ranks is unchanged.
        """
        engine, model, val = self.comm.engine, self.learner.model, self.data.val
        ctx = engine.global_parameters() if engine is not None else contextlib.nullcontext()
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        first, every = self.place.site.replica, self.place.site.replicas
        members = self.membership.members if self.membership is not None else None
        if members:  # an elastic run: the live sites share all the batches
            first, every = members.index(self.place.site.replica), len(members)
        with ctx, torch.no_grad(), self.autocast():
            for i in range(first, len(val), every):
                x, y = val[i]
                total[0] += model(x.to(self.place.device), y.to(self.place.device)).item()
                total[1] += 1
        model.train()
        self.comm.control.all_reduce(total, control=True)
        return float(total[0] / max(total[1], 1))


def set_up(spec: RunSpec, role: Role = FIXED_WORLD) -> Run:
    """Join the process group and build the model, optimizer, schedule and data of this rank
    (of this site, in an elastic run)."""
    cfg = spec.train
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    owns_group = init_distributed(cfg.timeout_s, device, gpus_for(cfg.device))
    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(role, ElasticSite):  # its own world: this site's ranks (one, or a torchrun's)
        rank, world = role.site * world + rank, role.sites * world
    site = site_of(rank, world, cfg.ranks_per_worker)
    owns_folder = rank == 0 or (role.alone and site.part == 0)
    if owns_folder:
        spec.out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(cfg.data, tokenizer=cfg.tokenizer)
    if owns_folder:
        corpus.save_description(spec.out)  # prints it once and writes DIR/corpus.json
    torch.manual_seed(cfg.seed)
    vocab = max(corpus.vocab_size, 1)
    model = build_model(cfg.model, vocab_size=vocab, max_seq_len=max(cfg.seq_len, 1)).to(device)
    inner_meter = ByteMeter()
    hsdp_meter = _shard_for_site(model, site, spec, device, inner_meter, elastic=role.elastic)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.inner_lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    batches = Batches(
        corpus.train, cfg.batch_size, cfg.seq_len, site.replica, site.replicas, cfg.seed,
        shard=cfg.shard,
    )  # fmt: skip
    val = val_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, seed=cfg.seed)
    return Run(
        spec=spec,
        place=Place(device, rank, world, owns_group, site, role),
        learner=Learner(model, opt, sched, vocab),
        data=Data(corpus.description, corpus.tokenizer_file, batches, val),
        comm=Comm(Transport(), inner_meter, hsdp_meter),
        progress=Progress(loss_sum=torch.zeros(2, dtype=torch.float64, device=device)),
    )


def _shard_for_site(
    model: nn.Module, site: Site, spec: RunSpec, device: torch.device, meter: ByteMeter,
    elastic: bool = False,
) -> ByteMeter | None:  # fmt: skip
    """FSDP2 inside a multi-rank worker (HSDP for per-step DDP); the HSDP meter, if any.
    With DDP inside, only the mesh: the model is wrapped in wrap_for_strategy. ``elastic``:
    the world is this site's ranks alone (the membership joins the sites)."""
    if not site.sharded:
        return None
    build_mesh(site, device, replicas=1 if elastic else site.replicas)
    if spec.train.inner_parallel == "ddp":
        return None
    hsdp = spec.strategy.per_step
    between = ByteMeter() if hsdp else meter
    shard_model(model, site, hsdp=hsdp, meter=meter, between=between)
    return between if hsdp else None


def wrap_for_strategy(run: Run) -> None:
    """Give the run its communication: DDP and a metered hook, or the engine (or a peer), its
    transports between workers made by the run's callbacks' factory."""
    if not run.spec.strategy.per_step:
        _attach_engine(run)
    else:
        _attach_ddp(run)
    register_state(run)


def _attach_ddp(run: Run) -> None:
    """A per-step strategy: DDP with the strategy's metered comm hook (HSDP with FSDP2 inside)."""
    model, place = run.learner.model, run.place
    if place.site.sharded and run.spec.train.inner_parallel == "fsdp":
        run.learner.train_model = model  # HSDP: FSDP2 reduces inside a worker, all-reduces between
        return
    grad_transport = run.callbacks.transports(Transport)(
        dist.new_group(backend=dist.get_backend()), None
    )
    # our own metered broadcast of the initial weights (DDP's would go uncounted)
    with torch.no_grad():
        for p in model.parameters():
            grad_transport.broadcast(p.data, src=0, control=True)
    ddp_kw: dict[str, Any] = {}
    if "init_sync" in nn.parallel.DistributedDataParallel.__init__.__code__.co_varnames:
        ddp_kw["init_sync"] = False
    ddp = nn.parallel.DistributedDataParallel(
        model,
        device_ids=[place.device.index] if place.device.type == "cuda" else None,
        process_group=grad_transport.group,
        **ddp_kw,
    )
    run.learner.train_model = ddp
    run.comm.hook_state, hook = _ddp_hook(run, grad_transport)
    ddp.register_comm_hook(run.comm.hook_state, hook)


def register_state(run: Run) -> None:
    """Each part declares its own state, in load order: data, engine and meters, schedule,
    model and optimizer, clock, then the random generators."""
    state = run.state
    run.data.register(state)
    run.comm.register(state)
    run.learner.register(state, run.place.site.sharded)
    run.progress.register(state)
    state.register("rng", StatePart(ckpt.rng_state, ckpt.set_rng_state))


def _attach_engine(run: Run) -> None:
    """An outer-loop strategy: our engine around the model (or a peer library's)."""
    spec, role = run.spec, run.place.role
    run.learner.train_model = run.learner.model
    peer = spec.strategy.engine(
        run.learner.model,
        run.learner.opt,
        spec.sync,
        timeout_s=spec.train.timeout_s,
        elastic=_elastic(run),
        peer_lighthouse=role.peer_lighthouse,
    )  # another library's outer loop, for a peer method (its settings checked by launch())
    if peer is not None:
        run.comm.engine = peer
    else:
        run.comm.engine = LowComm(
            _ddp_inside(run),
            run.learner.opt,
            spec.sync,
            mesh=run.place.site.mesh,
            timeout_s=spec.train.timeout_s,
            elastic=_elastic(run),
            transports=run.callbacks.transports(Transport),
        )
        run.callbacks.on_engine(run.comm.engine)
    if role.elastic:
        run.comm.control = QuorumControl(run.comm.engine)


def _elastic(run: Run) -> Elastic | None:
    """Membership settings of an elastic run's site (None in a fixed world)."""
    role = run.place.role
    if not isinstance(role, ElasticSite) or not run.spec.elastic:
        return None
    return site_membership(run.spec, role)


def _ddp_inside(run: Run) -> nn.Module:
    """The model the engine syncs: with DDP inside a multi-rank worker, the model wrapped in DDP
    over the worker's ranks (also what trains); else the bare model."""
    place = run.place
    if not (place.site.sharded and run.spec.train.inner_parallel == "ddp"):
        return run.learner.model
    group = place.site.mesh["shard"].get_group()
    ddp = nn.parallel.DistributedDataParallel(
        run.learner.model,
        device_ids=[place.device.index] if place.device.type == "cuda" else None,
        process_group=group,
    )
    run.learner.train_model = ddp
    # the gradient all-reduce inside the worker, metered apart (not waiting on the slow link)
    inner = GradReduceState(Transport(group, meter=run.comm.inner_meter))
    ddp.register_comm_hook(inner, allreduce_hook)
    return ddp


def _ddp_hook(run: Run, transport: Transport) -> tuple[GradReduceState, Callable[..., Any]]:
    """The comm hook of a per-step strategy and its state: LoCo, one of PyTorch's, or FP32."""
    cfg, s = run.spec.train, run.spec.sync
    hook = run.spec.strategy.hook(cfg)
    if hook == "loco":
        reduce = s.reduce if s.reduce in ("gather", "two-phase") else "auto"
        state = LoCoState(
            run.learner.model,
            transport,
            bits=s.loco_bits,
            beta=s.loco_beta,
            group_size=s.codec_block,
            reset_every=s.loco_reset_every,
            reduce=reduce,
            compensate=s.compensation == "loco",
            quantizer=s.loco_quantizer,
            compress_1d=s.loco_compress_1d,
        )
        return state, loco_hook
    return make_ddp_hook(hook, transport, cfg)


def init_distributed(timeout_s: float, device: torch.device, gpus: int | None = None) -> bool:
    """Join the process group described by the environment (torchrun / our launcher), on the
    backend :func:`backend_for` picks.

    Returns True when this call created the group (the caller then destroys it when done).
    """
    if dist.is_initialized():
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus is None:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = backend_for(device.type, local, gpus)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


def gpus_for(device: str) -> int:
    """How many GPUs this machine's ranks spread over: every one for ``cuda``/``auto`` (rank i
    takes GPU i mod count), one for ``cuda:N`` (they all take GPU N), none on the CPU."""
    if device == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count() if device in ("auto", "cuda") else 1


def backend_for(device_type: str, local_ranks: int, gpus: int) -> str:
    """The world's backend, by rule: gloo on the CPU; on GPUs, NCCL for CUDA tensors where
    each of this machine's ``local_ranks`` owns one of its ``gpus`` (gloo beside it for CPU
    tensors), and gloo alone where ranks share a GPU (NCCL refuses two ranks on one device;
    gloo stages CUDA tensors through pinned host memory). Groups made later inherit it."""
    if device_type != "cuda" or local_ranks > gpus:
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def resolve_device(name: str) -> torch.device:
    """auto -> cuda (this worker's local GPU) when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is available: use device=cpu")
        if name == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            name = f"cuda:{local % torch.cuda.device_count()}"
        torch.cuda.set_device(torch.device(name))
    return torch.device(name)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f
