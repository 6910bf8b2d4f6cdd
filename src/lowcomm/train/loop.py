"""The reference trainer: one worker's training loop, for every strategy.

Per-step strategies (``ddp``) wrap the model in DistributedDataParallel with a metered comm
hook; the others run the unchanged loop inside the engine's ``with`` block. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` (fields in docs/design.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import checkpoint as ckpt
from ..config import ConfigError, SyncConfig, TrainConfig
from ..bench import torchft_peer
from ..engine import LowComm
from ..loco import GradReduceState, LoCoState, TorchHookState, allreduce_hook, loco_hook, torch_hook
from ..presets import PER_STEP_STRATEGIES
from ..transport import Transport, ring_all_reduce_bytes
from .data import Batches, load_corpus, val_batches
from .model import build_model, count_params


def init_distributed(timeout_s: float, device: torch.device) -> bool:
    """Join the process group described by the environment (torchrun / our launcher).

    Returns True when this call created the group (the caller then destroys it when done).
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return True


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


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def git_rev() -> str:
    """The source tree's git revision (with -dirty), LOWCOMM_GIT_REV if set, or 'unknown'."""
    if os.environ.get("LOWCOMM_GIT_REV"):  # benchmarks run from a snapshot of the tree
        return os.environ["LOWCOMM_GIT_REV"]
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class _Clock:
    """Splits the training loop's time into compute and blocked, excluding evaluation."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.excluded = 0.0
        self.compute = 0.0
        self.blocked_extra = 0.0  # blocked time not seen by the engine's meter (DDP hooks)

    def wall(self) -> float:
        return time.perf_counter() - self.t0 - self.excluded


def run_worker(strategy: str, sync_cfg: SyncConfig, cfg: TrainConfig, out_dir: str | Path,
               name: str | None = None, resume: str | None = None) -> dict[str, Any] | None:
    """Train on this process's rank; returns the summary on rank 0 (None elsewhere).

    ``resume`` names a checkpoint folder to continue from (see :func:`restore`).
    """
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    owns_group = init_distributed(cfg.timeout_s, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(cfg.data, tokenizer=cfg.tokenizer)
    if rank == 0:
        corpus.save_description(out)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, vocab_size=max(corpus.vocab_size, 1),
                        max_seq_len=max(cfg.seq_len, 1)).to(device)
    n_params = count_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner_lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    batches = Batches(corpus.train, cfg.batch_size, cfg.seq_len, rank, world, cfg.seed, shard=cfg.shard)
    val = val_batches(corpus.val, cfg.batch_size, cfg.seq_len, cfg.eval_batches, seed=cfg.seed)
    control = Transport()  # loss logging and summaries: counted as control traffic

    _write_workers_json(out, rank)
    per_step = strategy in PER_STEP_STRATEGIES
    hook_state: GradReduceState | None = None
    engine: LowComm | None = None
    train_model: nn.Module = model
    if per_step:
        grad_transport = Transport(dist.new_group(backend=dist.get_backend()), delay_s=cfg.comm_delay_s)
        # our own metered broadcast of the initial weights (DDP's would go uncounted)
        with torch.no_grad():
            for p in model.parameters():
                grad_transport.broadcast(p.data, src=0, control=True)
        ddp_kw: dict[str, Any] = {}
        if "init_sync" in torch.nn.parallel.DistributedDataParallel.__init__.__code__.co_varnames:
            ddp_kw["init_sync"] = False
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            process_group=grad_transport.group, **ddp_kw)
        if strategy == "loco":
            hook_state = LoCoState(model, grad_transport, bits=cfg.loco_bits, beta=sync_cfg.loco_beta,
                                   group_size=sync_cfg.codec_block, reset_every=sync_cfg.loco_reset_every,
                                   reduce=sync_cfg.reduce if sync_cfg.reduce in ("gather", "two-phase") else "auto",
                                   compensate=sync_cfg.compensation == "loco")
            train_model.register_comm_hook(hook_state, loco_hook)
        elif cfg.ddp_hook != "allreduce":
            hook_state = TorchHookState(grad_transport, cfg.ddp_hook, rank=cfg.powersgd_rank,
                                        start_iter=cfg.powersgd_start)
            train_model.register_comm_hook(hook_state, torch_hook)
        else:
            hook_state = GradReduceState(grad_transport)
            train_model.register_comm_hook(hook_state, allreduce_hook)
    elif strategy == torchft_peer.STRATEGY:  # its settings were checked by launch()
        engine = torchft_peer.TorchftDiLoCo(model, opt, sync_cfg, timeout_s=cfg.timeout_s)
    else:
        engine = LowComm(model, opt, sync_cfg, timeout_s=cfg.timeout_s, comm_delay_s=cfg.comm_delay_s)

    def meter_totals() -> dict[str, float]:
        m = (engine.transport.meter if engine is not None and engine.transport is not None
             else hook_state.transport.meter if hook_state is not None else None)
        d = m.as_dict() if m is not None else {}
        for k in ("control_payload_bytes", "control_sent_bytes", "control_received_bytes"):
            d[k] = d.get(k, 0) + getattr(control.meter, k)
        return d

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())

    def evaluate() -> float:
        """Mean validation loss on the global parameters; batches split across workers."""
        ctx = engine.global_parameters() if engine is not None else contextlib.nullcontext()
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        with ctx, torch.no_grad(), autocast:
            for i in range(rank, len(val), world):
                x, y = val[i]
                total[0] += model(x.to(device), y.to(device)).item()
                total[1] += 1
        model.train()
        control.all_reduce(total, control=True)
        return float(total[0] / max(total[1], 1))

    start_step = 1
    resumed: dict[str, Any] | None = None
    if resume is not None:
        resumed = ckpt.load_rank_state(Path(resume), rank if _same_world(resume, world) else 0)
        start_step = int(resumed["step"]) + 1
    metrics_f = _open_metrics(out, rank, start_step)
    tokens_per_step = cfg.batch_size * cfg.seq_len * world
    bar = None
    if rank == 0 and cfg.progress and sys.stderr.isatty():  # no \r-spam in logs and CI
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, desc=name or strategy, unit="step", leave=False, dynamic_ncols=True)

    def log(record: dict[str, Any]) -> None:
        if metrics_f is not None:
            metrics_f.write(json.dumps(record) + "\n")
            metrics_f.flush()

    val_loss = float("nan")
    loss_sum = torch.zeros(2, dtype=torch.float64)
    pending_ckpt = False  # a checkpoint is due: taken at the next sync boundary
    run_cfg = {"strategy": strategy, "name": name, "sync": dataclasses.asdict(sync_cfg),
               "train": dataclasses.asdict(cfg)}
    with (engine if engine is not None else contextlib.nullcontext()):
        clock = _Clock()  # the loop starts after the engine's start-up broadcast
        if resumed is not None:
            restore(resumed, _same_world(resume, world), model, opt, sched, batches, engine,
                    hook_state, clock, control)
            if bar is not None:
                bar.update(start_step - 1)
        for step in range(start_step, cfg.steps + 1):
            t_step = time.perf_counter()
            blocked0 = engine.transport.meter.blocked_s if engine is not None else 0.0
            x, y = batches.next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                loss = train_model(x, y)
            if hook_state is not None:
                hook_state.last_launch = 0.0
            loss.backward()
            step_blocked_extra = 0.0
            if hook_state is not None and hook_state.last_launch:
                # backward returned this long after its last bucket was launched: network wait
                step_blocked_extra = time.perf_counter() - hook_state.last_launch
                clock.blocked_extra += step_blocked_extra
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()  # the engine's hook runs the outer step here when due
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss_sum[0] += loss.detach().item()
            loss_sum[1] += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            blocked = (engine.transport.meter.blocked_s - blocked0) if engine is not None else 0.0
            clock.compute += time.perf_counter() - t_step - blocked - step_blocked_extra

            t_side = time.perf_counter()  # logging and evaluation are not training time
            record: dict[str, Any] | None = None
            if step % cfg.log_every == 0 or step == cfg.steps:
                control.all_reduce(loss_sum, control=True)
                train_loss = float(loss_sum[0] / max(loss_sum[1], 1))
                loss_sum.zero_()
                totals = meter_totals()
                record = {"step": step, "tokens": step * tokens_per_step, "train_loss": train_loss,
                          "lr": sched.get_last_lr()[0], "bytes_sent": totals.get("sent_bytes", 0),
                          "payload_bytes": totals.get("payload_bytes", 0),
                          "wall_s": clock.wall(), "compute_s": clock.compute,
                          "blocked_s": totals.get("blocked_s", 0.0) + clock.blocked_extra}
            if step < cfg.steps and cfg.eval_every and step % cfg.eval_every == 0:
                val_loss = evaluate()
                record = record or {"step": step, "tokens": step * tokens_per_step}
                record["val_loss"] = val_loss
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                pending_ckpt = True
            if pending_ckpt and (engine is None or engine.last_sync_step == step):
                save_checkpoint(out, step, run_cfg, model, opt, sched, batches, engine, hook_state, clock,
                                control)
                pending_ckpt = False
            if record is not None:
                log(record)
                if bar is not None:
                    bar.set_postfix(loss=f"{record.get('train_loss', float('nan')):.3f}",
                                    MB=f"{record.get('bytes_sent', 0) / 1e6:.1f}", refresh=False)
            if bar is not None:
                bar.update(1)
            clock.excluded += time.perf_counter() - t_side
        if engine is not None:
            blocked0 = engine.transport.meter.blocked_s
            t_fin = time.perf_counter()
            engine.finish()  # drain in-flight results: the last sync ends the timed loop
            clock.compute += time.perf_counter() - t_fin - (engine.transport.meter.blocked_s - blocked0)
    wall_s = clock.wall()
    if bar is not None:
        bar.close()
    val_loss = evaluate()
    totals = meter_totals()
    blocked_s = totals.get("blocked_s", 0.0) + clock.blocked_extra
    log({"step": cfg.steps, "tokens": cfg.steps * tokens_per_step, "val_loss": val_loss,
         "wall_s": wall_s, "final": True})

    # per-worker figures averaged over workers; peak memory is the max
    vec = torch.tensor([totals.get("sent_bytes", 0), totals.get("received_bytes", 0),
                        totals.get("payload_bytes", 0), totals["control_sent_bytes"],
                        wall_s, clock.compute, blocked_s], dtype=torch.float64)
    control.all_reduce(vec, control=True)
    vec /= world
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    summary = None
    if rank == 0:
        m = world
        sent, recv, payload, control_sent, wall, compute, blocked = vec.tolist()
        cfg_dict = {**dataclasses.asdict(cfg), **({} if per_step else dataclasses.asdict(sync_cfg))}
        summary = {
            "name": name or strategy, "strategy": strategy, "workers": world, "params": n_params,
            "n_layers": len(getattr(model, "blocks", [])),
            "tokens": cfg.steps * tokens_per_step, "inner_steps": cfg.steps,
            "final_val_loss": val_loss,
            "bytes_sent_per_worker": int(sent), "bytes_received_per_worker": int(recv),
            "payload_bytes_per_worker": int(payload),
            "ddp_fp32_bytes_per_worker": int(cfg.steps * ring_all_reduce_bytes(4 * n_params, m)),
            "control_bytes_per_worker": int(control_sent),
            "syncs": engine.stats.syncs if engine is not None else cfg.steps,
            # per-step strategies send every step: their "sync" is one step's traffic
            "peak_bytes_per_sync": (engine.stats.peak_bytes_per_sync if engine is not None
                                    else int(sent / cfg.steps)),
            "wall_s": wall, "compute_s": compute, "blocked_s": blocked,
            "compute_utilization": compute / wall if wall > 0 else 0.0,
            "step_compute_s": compute / cfg.steps,
            "peak_rss_bytes": int(rss.item()), "seed": cfg.seed, "config": cfg_dict,
            "torch_version": torch.__version__, "git_rev": git_rev(),
            "device": str(device),
        }
        if engine is not None:
            for key in ("clipped_elements", "penalized_elements"):
                if hasattr(engine.outer, key):
                    summary[f"outer_{key}"] = getattr(engine.outer, key)
        # the trained model: the global parameters, identical on every worker
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, out / "model.pt")
        if hasattr(model, "save_pretrained"):  # Hugging Face models: from_pretrained(DIR/hf)
            model.save_pretrained(out / "hf", tokenizer_file=corpus.tokenizer_file)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        metrics_f.close()
        with contextlib.suppress(FileNotFoundError):
            (out / "workers.json").unlink()
    dist.barrier()
    if owns_group:
        # Tear gloo down while the interpreter is whole: left to interpreter exit, its worker
        # threads can still hold finished work and abort the process (SIGABRT, "terminate called
        # without an active exception"), seen on shaped links after the summary was written.
        dist.destroy_process_group()
    return summary


def _same_world(resume: str | None, world: int) -> bool:
    return resume is not None and ckpt.read_meta(Path(resume))["world_size"] == world


def _open_metrics(out: Path, rank: int, start_step: int):
    """Rank 0's metrics.jsonl; on resume, records after the checkpoint are dropped, then appended to."""
    if rank != 0:
        return None
    path = out / "metrics.jsonl"
    if start_step > 1 and path.exists():
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) < start_step and not json.loads(line).get("final")]
        path.write_text("".join(line + "\n" for line in keep))
        return open(path, "a")
    return open(path, "w")


def save_checkpoint(out: Path, step: int, run_cfg: dict[str, Any], model: nn.Module,
                    opt: torch.optim.Optimizer, sched: Any, batches: Batches, engine: LowComm | None,
                    hook_state: GradReduceState | None, clock: "_Clock", control: Transport) -> Path:
    """Every rank writes its state; rank 0 marks the checkpoint complete and prunes old ones.

    Taken at a sync boundary: the engine's in-flight results are awaited and stored as pending.
    """
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    d = ckpt.checkpoint_dir(out, step)
    state = {
        "step": step,
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "data": batches.state_dict(),
        "rng": ckpt.rng_state(),
        "engine": engine.state_dict() if engine is not None else {},
        "hook": hook_state.state_dict() if isinstance(hook_state, LoCoState) else {},
        "clock": {"compute": clock.compute, "blocked_extra": clock.blocked_extra, "wall": clock.wall()},
        "meters": {"hook": hook_state.transport.meter.as_dict() if hook_state is not None else {},
                   "control": control.meter.as_dict()},
    }
    sha = ckpt.save_rank_state(d, rank, state)
    shas: list[Any] = [None] * world
    dist.all_gather_object(shas, sha)
    if rank == 0:
        ckpt.finalize(d, step=step, world_size=world, checksums=shas, config=run_cfg, extra={"run": run_cfg})
        ckpt.prune(out, keep=3, checksums=False)
    dist.barrier()
    clock.excluded += time.perf_counter() - t0  # checkpointing is not training time
    return d


def restore(state: dict[str, Any], same_world: bool, model: nn.Module, opt: torch.optim.Optimizer,
            sched: Any, batches: Batches, engine: LowComm | None, hook_state: GradReduceState | None,
            clock: "_Clock", control: Transport) -> None:
    """Load a checkpoint into a started run.

    Same number of workers: everything, so the run continues bit-identically on CPU.
    A different number: the global parameters, outer optimizer state, step counter and LR
    schedule carry over; every worker starts from the global parameters with fresh inner
    optimizer state and error buffers, on its new data shard; results in flight are dropped.
    """
    sched.load_state_dict(state["scheduler"])
    batches.load_state_dict(state["data"])
    if isinstance(hook_state, TorchHookState) and hook_state.kind == "powersgd" and dist.get_rank() == 0:
        # PyTorch keeps PowerSGD's memories by bucket index with a numpy RNG: not checkpointed
        print("lowcomm: resuming a PowerSGD run restarts PyTorch's PowerSGD error-feedback and "
              "warm-start memories (they are not part of the checkpoint)", file=sys.stderr)
    if same_world:
        if engine is not None:
            engine.load_state_dict(state["engine"])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if isinstance(hook_state, LoCoState) and state["hook"]:
            hook_state.load_state_dict(state["hook"])
        ckpt.set_rng_state(state["rng"])
        if hook_state is not None:
            hook_state.transport.meter.load_dict(state["meters"]["hook"])
        control.meter.load_dict(state["meters"]["control"])
        clock.compute = state["clock"]["compute"]
        clock.blocked_extra = state["clock"]["blocked_extra"]
        clock.t0 -= state["clock"]["wall"]
        return
    if engine is not None:
        sd = dict(state["engine"], pending={}, compensation={}, left_out=[])
        engine.load_state_dict(sd)
        with torch.no_grad():
            for name, value in engine.global_state().items():
                dict(model.named_parameters())[name].copy_(value)
    else:
        model.load_state_dict(state["model"])
    # keep the schedule's position: AdamW's per-parameter moments are per worker and start fresh
    for group, saved in zip(opt.param_groups, state["optimizer"]["param_groups"]):
        group["lr"] = saved["lr"]


def _write_workers_json(out: Path, rank: int) -> None:
    """DIR/workers.json: rank and pid of each live local worker, for operators and scripts."""
    entries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, {"rank": rank, "pid": os.getpid(), "host": os.uname().nodename})
    if rank == 0:
        tmp = out / "workers.json.tmp"
        tmp.write_text(json.dumps(entries, indent=2) + "\n")
        tmp.replace(out / "workers.json")
