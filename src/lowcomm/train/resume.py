"""Checkpoints of a running trainer: what a run saves at a sync boundary and how it continues.

The file format (per-rank files, meta.json, checksums, pruning) is :mod:`lowcomm.checkpoint`;
this module decides what goes in them for a :class:`~lowcomm.train.run.Run`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..config import ConfigError, SyncConfig, TrainConfig
from ..loco import LoCoState, TorchHookState
from .run import Run

KEEP = 3
"""Complete checkpoints kept per run folder (older ones are pruned)."""


def run_config(run: Run) -> dict[str, Any]:
    """The settings saved with every checkpoint: what ``--resume`` rebuilds the run from."""
    return settings(run.strategy, run.name, run.sync_cfg, run.cfg)


def settings(
    strategy: str, name: str | None, sync_cfg: SyncConfig, cfg: TrainConfig
) -> dict[str, Any]:
    """A run's settings as saved (checkpoints, an elastic run's DIR/elastic.json)."""
    return {
        "strategy": strategy,
        "name": name,
        "sync": dataclasses.asdict(sync_cfg),
        "train": dataclasses.asdict(cfg),
    }


def save_checkpoint(run: Run, step: int) -> Path:
    """Every rank writes its state; rank 0 marks the checkpoint complete and prunes old ones.

    Taken at a sync boundary: the engine's in-flight results are awaited and stored as pending.
    An elastic run's sites come and go, so there the lowest live site alone writes its state,
    as a checkpoint of one worker: a resume continues from its global copy and outer state
    (the path of a resume on another number of workers).
    """
    d = ckpt.checkpoint_dir(run.out, step)
    if run.role is not None:
        if run.writes:
            _save_one(run, step, d)
        return d
    if run.site.sharded:  # FSDP2 shards: through torch.distributed.checkpoint, beside the files
        _save_sharded(run, d)
    state = _rank_state(run, step)
    sha = ckpt.save_rank_state(d, run.rank, state)
    shas: list[Any] = [None] * run.world
    dist.all_gather_object(shas, sha)
    if run.rank == 0:
        _finalize(run, step, d, shas)
    dist.barrier()
    return d


def _rank_state(run: Run, step: int) -> dict[str, Any]:
    """Everything this rank needs to continue: model, optimizer, data, RNG, engine, meters."""
    hook = run.hook_state
    sharded = run.site.sharded
    return {
        "step": step,
        "sharded": sharded,
        "model": {}
        if sharded
        else {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optimizer": {} if sharded else run.opt.state_dict(),
        "scheduler": run.sched.state_dict(),
        "data": run.batches.state_dict(),
        "rng": ckpt.rng_state(),
        "engine": run.engine.state_dict() if run.engine is not None else {},
        "hook": hook.state_dict() if isinstance(hook, LoCoState) else {},
        "clock": run.clock.state_dict(),
        "meters": {
            "hook": hook.transport.meter.as_dict() if hook is not None else {},
            "control": run.control.meter.as_dict(),
            "inner": run.inner_meter.as_dict(),
            "hsdp": run.hsdp_meter.as_dict() if run.hsdp_meter is not None else {},
        },
    }


def _save_one(run: Run, step: int, d: Path) -> None:
    """The writing site's state as the checkpoint of a one-worker run."""
    _finalize(run, step, d, [ckpt.save_rank_state(d, 0, _rank_state(run, step))])


def _finalize(run: Run, step: int, d: Path, shas: list[Any]) -> None:
    """meta.json (the checkpoint is complete from here on), then the older ones pruned."""
    cfg = run_config(run)
    extra = {"run": cfg, "sites": run.world}  # an elastic run's file count is not its sites
    ckpt.finalize(d, step=step, world_size=len(shas), checksums=shas, config=cfg, extra=extra)
    ckpt.prune(run.out, keep=KEEP, checksums=False)


def load_state(run: Run, resume: str | Path) -> dict[str, Any]:
    """This rank's saved state from checkpoint folder ``resume`` (rank 0's if the world changed)."""
    same = same_world(run, resume)
    state = ckpt.load_rank_state(Path(resume), run.rank if same else 0)
    if (state.get("sharded") or run.site.sharded) and not same:
        raise ConfigError(
            f"{resume} was written by {ckpt.read_meta(Path(resume))['world_size']} ranks and "
            f"this run has {run.world}: a run with several ranks per worker resumes on the same "
            f"workers x ranks_per_worker"
        )
    state["same_world"] = same
    if state.get("sharded"):
        # before the engine hooks the optimizer: torch.distributed.checkpoint first builds the
        # optimizer's state with a zero-gradient step, which the engine would count
        _load_sharded(run, Path(resume))
    return state


def same_world(run: Run, resume: str | Path) -> bool:
    """True when the checkpoint was written by as many workers as this run has."""
    return ckpt.read_meta(Path(resume))["world_size"] == run.world


def restore(run: Run, state: dict[str, Any]) -> None:
    """Load a checkpoint (from :func:`load_state`) into a started run.

    Same number of workers: everything, so the run continues bit-identically on CPU.
    A different number: the global parameters, outer optimizer state, step counter and LR
    schedule carry over; every worker starts from the global parameters with fresh inner
    optimizer state and error buffers, on its new data shard; results in flight are dropped.
    """
    run.sched.load_state_dict(state["scheduler"])
    run.batches.load_state_dict(state["data"])
    hook = run.hook_state
    if isinstance(hook, TorchHookState) and hook.kind == "powersgd" and run.rank == 0:
        # PyTorch keeps PowerSGD's memories by bucket index with a numpy RNG: not checkpointed
        print(
            "lowcomm: resuming a PowerSGD run restarts PyTorch's PowerSGD error-feedback and "
            "warm-start memories (they are not part of the checkpoint)",
            file=sys.stderr,
        )
    if state["same_world"]:
        _restore_everything(run, state)
        return
    if run.engine is not None:
        run.engine.load_state_dict(state["engine"], new_world=True)
        params = dict(run.model.named_parameters())
        with torch.no_grad():
            for name, value in run.engine.global_state().items():
                params[name].copy_(value)
    else:
        run.model.load_state_dict(state["model"])
    # keep the schedule's position: AdamW's per-parameter moments are per worker and start fresh
    for group, saved in zip(run.opt.param_groups, state["optimizer"]["param_groups"]):
        group["lr"] = saved["lr"]


def _restore_everything(run: Run, state: dict[str, Any]) -> None:
    """Same world: every piece of state, meters and clock included."""
    if run.engine is not None:
        run.engine.load_state_dict(state["engine"])
    if not state.get("sharded"):  # sharded ones were loaded by load_state()
        run.model.load_state_dict(state["model"])
        run.opt.load_state_dict(state["optimizer"])
    hook = run.hook_state
    if isinstance(hook, LoCoState) and state["hook"]:
        hook.load_state_dict(state["hook"])
    ckpt.set_rng_state(state["rng"])
    if hook is not None:
        hook.transport.meter.load_dict(state["meters"]["hook"])
    run.control.meter.load_dict(state["meters"]["control"])
    run.inner_meter.load_dict(state["meters"].get("inner", {}))
    if run.hsdp_meter is not None:
        run.hsdp_meter.load_dict(state["meters"].get("hsdp", {}))
    run.clock.load_state_dict(state["clock"])


def _save_sharded(run: Run, d: Path) -> None:
    """Model and inner optimizer of an FSDP2 worker, every rank's shards (a collective).

    One checkpoint per worker, written by that worker's ranks: between syncs the workers'
    weights differ, and torch.distributed.checkpoint would keep one copy of what it takes for
    replicated data.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(run.model, run.opt)
    dcp.save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=str(_sharded_dir(run, d)),
        process_group=_worker_group(run),
    )


def _load_sharded(run: Run, d: Path) -> None:
    """Load what :func:`_save_sharded` wrote into this run's model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(run.model, run.opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(_sharded_dir(run, d)), process_group=_worker_group(run))
    set_state_dict(
        run.model, run.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def _sharded_dir(run: Run, d: Path) -> Path:
    return d / "sharded" / f"worker{run.site.replica}"


def _worker_group(run: Run) -> Any:
    """The ranks of this rank's worker (FSDP2's "shard" dimension)."""
    return run.site.mesh["shard"].get_group()
