"""The engine's state in a Hugging Face Trainer checkpoint, one file per rank.

A Trainer checkpoint (``checkpoint-N/``) holds the model, rank 0's optimizer and scheduler, each
rank's RNG state and the Trainer's own state. The outer loop needs more to continue exactly:
each rank's engine state (the global copy, outer optimizer state, error feedback, results in
flight, the schedule's position and its local weights) and its own inner optimizer state, since
the Trainer saves rank 0's and loads that on every rank. :func:`save_state` writes them as
``lowcomm-rank{R}.pt`` beside the Trainer's files; :func:`load_state` reads them back and
refuses, with one line, a checkpoint of another strategy, world size or engine setting.
No torch.distributed here: the callers are the Trainer's callbacks, on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..durable import atomic_write, check_weights_only_safe
from ..errors import CheckpointError, ConfigError

FORMAT = 1  # the layout of the file below; a later lowcomm reads older ones or says it cannot
PREFIX = "lowcomm-rank"


def state_path(checkpoint: Path, rank: int) -> Path:
    """This rank's engine file inside a Trainer checkpoint folder."""
    return Path(checkpoint) / f"{PREFIX}{rank}.pt"


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must share with the run that resumes from it."""

    strategy: str
    world_size: int  # workers (processes) in the run
    settings: dict[str, Any]  # the engine's config, flattened to key -> plain value

    @classmethod
    def of(cls, strategy: str, world_size: int, config: Any) -> RunIdentity:
        """The identity of a run of ``strategy`` on ``world_size`` workers with engine
        ``config`` (a dataclass)."""
        return cls(strategy, int(world_size), _flat(dataclasses.asdict(config)))


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys; tuples as lists (as they load back)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def save_state(
    checkpoint: Path,
    rank: int,
    identity: RunIdentity,
    step: int,
    engine: dict[str, Any],
    optimizer: dict[str, Any],
) -> Path:
    """Write this rank's engine and inner optimizer state at optimizer step ``step`` into
    ``checkpoint`` (atomically: a crash leaves no torn file)."""
    checkpoint = Path(checkpoint)
    checkpoint.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "rank": int(rank),
        "step": int(step),
        "strategy": identity.strategy,
        "world_size": identity.world_size,
        "settings": identity.settings,
        "engine": engine,
        "optimizer": optimizer,
    }
    check_weights_only_safe(payload)
    path = state_path(checkpoint, rank)
    atomic_write(path, lambda f: torch.save(payload, f))
    return path


def load_state(
    checkpoint: Path, rank: int, identity: RunIdentity, step: int, fresh: str
) -> dict[str, Any]:
    """This rank's saved ``{"engine": ..., "optimizer": ...}``, checked against the run that
    resumes at Trainer step ``step``. ``fresh`` spells, as the caller's user writes it, the
    option that starts the outer loop afresh from the checkpoint's model instead."""
    checkpoint = Path(checkpoint)
    path = state_path(checkpoint, rank)
    afresh = f"or pass {fresh} to start the outer loop afresh from its saved model"
    if not path.is_file():
        raise _missing(checkpoint, rank, identity, afresh)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a torn or foreign file: its own error says which
        raise CheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0]}): "
            f"resume from an earlier checkpoint, {afresh}"
        ) from err
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a lowcomm engine file of format {FORMAT}: resume it with the "
            f"lowcomm that wrote it, {afresh}"
        )
    _check(checkpoint, saved, rank, identity, step, afresh)
    return {"engine": saved["engine"], "optimizer": saved["optimizer"]}


def _missing(checkpoint: Path, rank: int, identity: RunIdentity, afresh: str) -> Exception:
    """The error for a checkpoint without this rank's file: of another world size when other
    ranks' files are there, else one that holds no engine state at all."""
    others = sorted(checkpoint.glob(f"{PREFIX}*.pt"))
    for other in others:
        try:
            saved = torch.load(other, map_location="cpu", weights_only=True)
            world = int(saved["world_size"])
        except Exception:
            continue
        return ConfigError(
            f"checkpoint {checkpoint} was written by {world} workers and this run has "
            f"{identity.world_size}: resume it on {world} workers "
            f"(torchrun --nproc-per-node {world}), {afresh}"
        )
    return CheckpointError(
        f"checkpoint {checkpoint} holds no lowcomm engine state ({PREFIX}{rank}.pt): it was "
        f"saved with save_only_model=True or without lowcomm, so it cannot resume the outer "
        f"loop (global copy, outer momentum, error feedback); resume from a checkpoint that "
        f"has it, {afresh}"
    )


def _check(
    checkpoint: Path,
    saved: dict[str, Any],
    rank: int,
    identity: RunIdentity,
    step: int,
    afresh: str,
) -> None:
    """Refuse a file of another rank, strategy, world size, setting or save, in one line."""
    where = f"checkpoint {checkpoint}"
    if saved["rank"] != rank:
        raise CheckpointError(
            f"{state_path(checkpoint, rank)} holds rank {saved['rank']}'s state, not rank "
            f"{rank}'s: the files were renamed or copied; resume from an intact checkpoint, "
            f"{afresh}"
        )
    if saved["strategy"] != identity.strategy:
        raise ConfigError(
            f"{where} was written by strategy {saved['strategy']!r} and this run is "
            f"{identity.strategy!r}: resume with strategy {saved['strategy']!r}, {afresh}"
        )
    if saved["world_size"] != identity.world_size:
        raise ConfigError(
            f"{where} was written by {saved['world_size']} workers and this run has "
            f"{identity.world_size}: resume it on {saved['world_size']} workers "
            f"(torchrun --nproc-per-node {saved['world_size']}), {afresh}"
        )
    was, now = saved["settings"], identity.settings
    differ = [k for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    if differ:
        shown = ", ".join(f"{k}={was.get(k)!r} (this run: {now.get(k)!r})" for k in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(
            f"{where} was written with other engine settings: {shown}{more}; resume with the "
            f"checkpoint's settings, {afresh}"
        )
    if saved["step"] != step:
        raise CheckpointError(
            f"{where}'s engine state is of step {saved['step']} and its Trainer state of step "
            f"{step}: they come from different saves; resume from another checkpoint, {afresh}"
        )
