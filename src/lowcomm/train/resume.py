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
from ..loco import LoCoState, TorchHookState
from .run import Run

KEEP = 3
"""Complete checkpoints kept per run folder (older ones are pruned)."""


def run_config(run: Run) -> dict[str, Any]:
    """The settings saved with every checkpoint: what ``--resume`` rebuilds the run from."""
    return {
        "strategy": run.strategy,
        "name": run.name,
        "sync": dataclasses.asdict(run.sync_cfg),
        "train": dataclasses.asdict(run.cfg),
    }


def save_checkpoint(run: Run, step: int) -> Path:
    """Every rank writes its state; rank 0 marks the checkpoint complete and prunes old ones.

    Taken at a sync boundary: the engine's in-flight results are awaited and stored as pending.
    """
    d = ckpt.checkpoint_dir(run.out, step)
    hook = run.hook_state
    state = {
        "step": step,
        "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optimizer": run.opt.state_dict(),
        "scheduler": run.sched.state_dict(),
        "data": run.batches.state_dict(),
        "rng": ckpt.rng_state(),
        "engine": run.engine.state_dict() if run.engine is not None else {},
        "hook": hook.state_dict() if isinstance(hook, LoCoState) else {},
        "clock": run.clock.state_dict(),
        "meters": {
            "hook": hook.transport.meter.as_dict() if hook is not None else {},
            "control": run.control.meter.as_dict(),
        },
    }
    sha = ckpt.save_rank_state(d, run.rank, state)
    shas: list[Any] = [None] * run.world
    dist.all_gather_object(shas, sha)
    if run.rank == 0:
        cfg = run_config(run)
        ckpt.finalize(
            d, step=step, world_size=run.world, checksums=shas, config=cfg, extra={"run": cfg}
        )
        ckpt.prune(run.out, keep=KEEP, checksums=False)
    dist.barrier()
    return d


def load_state(run: Run, resume: str | Path) -> dict[str, Any]:
    """This rank's saved state from checkpoint folder ``resume`` (rank 0's if the world changed)."""
    state = ckpt.load_rank_state(Path(resume), run.rank if same_world(run, resume) else 0)
    state["same_world"] = same_world(run, resume)
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
        run.engine.load_state_dict(
            dict(
                state["engine"],
                pending={},
                compensation={},
                left_out=[],
                local=None,
                snapshot={},
                reduce_compensation={},
            )
        )
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
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optimizer"])
    hook = run.hook_state
    if isinstance(hook, LoCoState) and state["hook"]:
        hook.load_state_dict(state["hook"])
    ckpt.set_rng_state(state["rng"])
    if hook is not None:
        hook.transport.meter.load_dict(state["meters"]["hook"])
    run.control.meter.load_dict(state["meters"]["control"])
    run.clock.load_state_dict(state["clock"])
