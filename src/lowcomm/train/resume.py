"""Checkpoints of a running trainer: what a run saves at a sync boundary and how it continues.

The file format (per-rank files, meta.json, checksums, pruning) is :mod:`lowcomm.train.checkpoint`;
this module decides what goes in them for a :class:`~lowcomm.train.run.Run`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..transport import Transport
from . import checkpoint as ckpt
from .run import Run

KEEP = 3
"""Complete checkpoints kept per run folder (older ones are pruned)."""


def save_checkpoint(run: Run, step: int) -> Path:
    """Every rank writes its state; rank 0 marks the checkpoint complete and prunes old ones.

    Taken at a sync boundary: the engine's in-flight results are awaited and stored as pending.
    An elastic run's sites come and go, so there the lowest live site alone writes its state,
    as a checkpoint of one worker: a resume continues from its global copy and outer state
    (the path of a resume on another number of workers).
    """
    d = ckpt.checkpoint_dir(run.spec.out, step)
    if run.place.role.elastic:
        if run.writes:
            _save_one(run, step, d)
        return d
    if run.place.site.sharded:  # FSDP2 shards: torch.distributed.checkpoint, beside the files
        _save_sharded(run, d)
    state = _rank_state(run, step)
    sha = ckpt.save_rank_state(d, run.place.rank, state)
    world = Transport()
    shas = world.all_gather_object(sha)
    if run.place.rank == 0:
        _finalize(run, step, d, shas)
    world.barrier()
    return d


# what a rank's file holds beside the registered state: the step and how the model was saved
_HEADER = ("step", "sharded")


def _rank_state(run: Run, step: int) -> dict[str, Any]:
    """Everything this rank needs to continue: the run's registered state (model, optimizer,
    data, RNG, engine, meters ...), with the step it was taken at."""
    return {"step": step, "sharded": run.place.site.sharded, **run.state.state_dict()}


def _save_one(run: Run, step: int, d: Path) -> None:
    """The writing site's state as the checkpoint of a one-worker run."""
    _finalize(run, step, d, [ckpt.save_rank_state(d, 0, _rank_state(run, step))])


def _finalize(run: Run, step: int, d: Path, shas: list[Any]) -> None:
    """meta.json (the checkpoint is complete from here on), then the older ones pruned."""
    cfg = run.spec.settings()
    extra = {"run": cfg, "sites": run.place.world}  # an elastic run's file count is not its sites
    ckpt.finalize(d, step=step, world_size=len(shas), checksums=shas, config=cfg, extra=extra)
    ckpt.prune(run.spec.out, keep=KEEP, checksums=False)


def load_state(run: Run, resume: str | Path) -> dict[str, Any]:
    """This rank's saved state from checkpoint folder ``resume`` (rank 0's if the world changed)."""
    same = same_world(run, resume)
    state = ckpt.load_rank_state(Path(resume), run.place.rank if same else 0)
    if (state.get("sharded") or run.place.site.sharded) and not same:
        raise ConfigError(
            f"{resume} was written by {ckpt.read_meta(Path(resume))['world_size']} ranks and "
            f"this run has {run.place.world}: a run with several ranks per worker resumes on "
            f"the same workers x ranks_per_worker"
        )
    state["same_world"] = same
    if state.get("sharded"):
        # before the engine hooks the optimizer: torch.distributed.checkpoint first builds the
        # optimizer's state with a zero-gradient step, which the engine would count
        _load_sharded(run, Path(resume))
    return state


def same_world(run: Run, resume: str | Path) -> bool:
    """True when the checkpoint was written by as many workers as this run has."""
    return ckpt.read_meta(Path(resume))["world_size"] == run.place.world


def restore(run: Run, state: dict[str, Any]) -> None:
    """Load a checkpoint (from :func:`load_state`) into a started run.

    Same number of workers: everything, so the run continues bit-identically on CPU.
    A different number: the global parameters, outer optimizer state, step counter and LR
    schedule carry over; every worker starts from the global parameters with fresh inner
    optimizer state and error buffers, on its new data shard; results in flight are dropped.
    """
    hook = run.comm.hook_state
    if hook is not None and hook.resume_note and run.place.rank == 0:
        print(f"lowcomm: {hook.resume_note}", file=sys.stderr)
    if state["same_world"]:
        _restore_everything(run, state)
        return
    run.learner.sched.load_state_dict(state["scheduler"])
    run.data.batches.load_state_dict(state["data"])
    if run.comm.engine is not None:
        run.comm.engine.load_state_dict(state["engine"], new_world=True)
        params = dict(run.learner.model.named_parameters())
        with torch.no_grad():
            for name, value in run.comm.engine.global_state().items():
                params[name].copy_(value)
    else:
        run.learner.model.load_state_dict(state["model"])
    # keep the schedule's position: AdamW's per-parameter moments are per worker and start fresh
    for group, saved in zip(run.learner.opt.param_groups, state["optimizer"]["param_groups"]):
        group["lr"] = saved["lr"]


def _restore_everything(run: Run, state: dict[str, Any]) -> None:
    """Same world: every piece of registered state, meters and clock included (sharded model
    and optimizer were loaded by :func:`load_state`)."""
    run.state.load_state_dict({k: v for k, v in state.items() if k not in (*_HEADER, "same_world")})


def _save_sharded(run: Run, d: Path) -> None:
    """Model and inner optimizer of an FSDP2 worker, every rank's shards (a collective).

    One checkpoint per worker, written by that worker's ranks: between syncs the workers'
    weights differ, and torch.distributed.checkpoint would keep one copy of what it takes for
    replicated data.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(run.learner.model, run.learner.opt)
    dcp.save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=str(_sharded_dir(run, d)),
        process_group=_worker_group(run),
    )


def _load_sharded(run: Run, d: Path) -> None:
    """Load what :func:`_save_sharded` wrote into this run's model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(run.learner.model, run.learner.opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(_sharded_dir(run, d)), process_group=_worker_group(run))
    set_state_dict(
        run.learner.model,
        run.learner.opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )


def _sharded_dir(run: Run, d: Path) -> Path:
    return d / "sharded" / f"worker{run.place.site.replica}"


def _worker_group(run: Run) -> Any:
    """The ranks of this rank's worker (FSDP2's "shard" dimension)."""
    return run.place.site.mesh["shard"].get_group()
