"""Checkpoint files: per-rank state files plus a meta.json that marks a checkpoint complete.

Layout::

    RUN_DIR/checkpoints/step-000001000/rank0.pt
                                      /rank1.pt
                                      /meta.json   (written last, by rank 0)

A checkpoint is *complete* only when meta.json exists and every rank file it lists exists with
the recorded SHA-256. Every file is written atomically (temp file in the same folder, fsync,
``os.replace``, fsync the folder), so a crash leaves either the old file or the new one, never a
torn one. No torch.distributed here: the caller gathers the per-rank checksums to rank 0.

Typical use (rank r of W)::

    d = checkpoint_dir(run_dir, step)
    sha = save_rank_state(d, r, state)                 # every rank
    shas = gather(sha)                                 # caller's collective
    if r == 0:
        finalize(d, step=step, world_size=W, checksums=shas, config=cfg_dict)
        prune(run_dir, keep=3)
    ...
    d = latest_complete(run_dir, world_size=W)         # on resume (rank 0, then broadcast)
    state = load_rank_state(d, r)
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..durable import (
    atomic_write,
    check_weights_only_safe,
    ensure_dir,
    fsync_dir,
    sha256_file,
)
from ..errors import CheckpointError  # noqa: F401  (re-exported)

META_NAME = "meta.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointWarning(UserWarning):
    """An incomplete or corrupt checkpoint was skipped."""


# ---------------------------------------------------------------- paths


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """The folder of the checkpoint taken after inner step ``step``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return Path(run_dir) / "checkpoints" / f"step-{step:09d}"


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    """The state file of ``rank`` inside ``ckpt_dir``."""
    return Path(ckpt_dir) / f"rank{rank}.pt"


def step_of(ckpt_dir: Path) -> int:
    """The step encoded in a checkpoint folder's name."""
    m = _STEP_RE.match(Path(ckpt_dir).name)
    if m is None:
        raise ValueError(
            f"{ckpt_dir} is not a checkpoint folder (expected a name like step-000000100)"
        )
    return int(m.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """All checkpoint folders under ``run_dir``, complete or not, sorted by step (oldest first)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=step_of)


# ---------------------------------------------------------------- writing


def save_rank_state(ckpt_dir: Path, rank: int, state: dict) -> str:
    """Atomically write ``rank{rank}.pt`` and return its SHA-256 hex digest."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__qualname__}")
    check_weights_only_safe(state)  # fail now, not at resume time
    ckpt_dir = Path(ckpt_dir)
    ensure_dir(ckpt_dir)
    # Re-saving into a folder that already has a meta.json (e.g. the run was resumed from an older
    # checkpoint and reached this step again): the old meta no longer describes the files being
    # replaced, so drop it; rank 0 writes the new one after every rank has finished.
    meta = ckpt_dir / META_NAME
    if meta.exists():
        meta.unlink(missing_ok=True)
        fsync_dir(ckpt_dir)
    return atomic_write(rank_file(ckpt_dir, rank), lambda f: torch.save(state, f))


def _lowcomm_version() -> str:
    try:  # late import: the package __init__ imports the engine, which may import this module
        from . import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def write_meta(ckpt_dir: Path, meta: dict, checksums: dict[int, str]) -> None:
    """Atomically write meta.json (marking the checkpoint complete); call after every rank
    file is written."""
    ckpt_dir = Path(ckpt_dir)
    if "step" not in meta:
        raise ValueError("meta must contain 'step'")
    step = meta["step"]
    if step_of(ckpt_dir) != step:
        raise ValueError(f"meta step {step} does not match folder {ckpt_dir.name}")
    shas = {int(r): sha for r, sha in checksums.items()}  # JSON round-trips turn int keys into str
    ranks = sorted(shas)
    world_size = int(meta.get("world_size", len(ranks)))
    if ranks != list(range(world_size)):
        raise ValueError(f"checksums cover ranks {ranks}, expected 0..{world_size - 1}")
    for r, sha in shas.items():
        if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise ValueError(f"checksum of rank {r} is not a SHA-256 hex digest: {sha!r}")
    now = time.time()
    out = {
        "format": FORMAT_VERSION,
        "lowcomm_version": _lowcomm_version(),
        "created": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
        "created_unix": now,
        **meta,
        "step": step,
        "world_size": world_size,
        "files": {rank_file(ckpt_dir, r).name: shas[r] for r in ranks},
    }
    data = json.dumps(out, indent=2, sort_keys=True).encode() + b"\n"  # raises on non-JSON values
    ensure_dir(ckpt_dir)
    atomic_write(ckpt_dir / META_NAME, lambda f: f.write(data))


def finalize(
    ckpt_dir: Path,
    *,
    step: int,
    world_size: int,
    checksums: dict[int, str] | list[str],
    config: dict | None = None,
    extra: dict | None = None,
    verify: bool = False,
) -> Path:
    """Write meta.json for a fully written checkpoint (rank 0 only) and return its folder."""
    ckpt_dir = Path(ckpt_dir)
    shas = dict(enumerate(checksums)) if isinstance(checksums, list) else dict(checksums)
    if verify:  # re-hash every rank file; needs them all visible here (shared filesystem)
        for r, sha in shas.items():
            problem = _check_file(rank_file(ckpt_dir, r), sha)
            if problem:
                raise CheckpointError(
                    f"not finalizing {ckpt_dir}: {rank_file(ckpt_dir, r).name} {problem}"
                )
    meta: dict[str, Any] = dict(extra or {})
    meta.update(
        step=step,
        world_size=world_size,
        config_hash=config_hash(config) if config is not None else None,
    )
    write_meta(ckpt_dir, meta, shas)
    return ckpt_dir


def config_hash(config: dict) -> str:
    """Stable SHA-256 of a JSON-serialisable dict (sorted keys, compact separators)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------- reading and verifying


def read_meta(ckpt_dir: Path) -> dict:
    """Parse meta.json of ``ckpt_dir``; CheckpointError if it is missing or unreadable."""
    path = Path(ckpt_dir) / META_NAME
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete (never finalized)"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path} has no 'files' table")
    return meta


def _check_file(path: Path, expected_sha256: str | None) -> str | None:
    """None if ``path`` exists (and matches the digest when one is given), else the problem."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    if expected_sha256 is None:
        return None
    actual = sha256_file(path)
    if actual != expected_sha256:
        return (
            f"fails its checksum ({size} bytes, sha256 {actual[:12]}..., "
            f"expected {expected_sha256[:12]}...): "
            "the file is truncated or corrupted"
        )
    return None


def verify_checkpoint(
    ckpt_dir: Path, world_size: int | None = None, *, checksums: bool = True
) -> dict:
    """Return the meta of a complete checkpoint, else raise CheckpointError saying why."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    ws = meta.get("world_size")
    if world_size is not None and ws != world_size:
        raise CheckpointError(f"{ckpt_dir} was written by {ws} ranks, this run has {world_size}")
    expected = {f"rank{r}.pt" for r in range(ws)} if isinstance(ws, int) else None
    if expected is None or set(meta["files"]) != expected:
        raise CheckpointError(
            f"{ckpt_dir / META_NAME} lists files {sorted(meta['files'])}, "
            f"expected one per rank of {ws}"
        )
    for name, sha in sorted(meta["files"].items()):
        problem = _check_file(ckpt_dir / name, sha if checksums else None)
        if problem:
            raise CheckpointError(f"{ckpt_dir / name} {problem}")
    return meta


def latest_complete(
    run_dir: Path,
    world_size: int | None = None,
    *,
    before_step: int | None = None,
    checksums: bool = True,
) -> Path | None:
    """Newest checkpoint that verifies (optionally older than ``before_step``); warns about
    each one skipped."""
    for d in reversed(list_checkpoints(run_dir)):
        if before_step is not None and step_of(d) >= before_step:
            continue
        try:
            verify_checkpoint(d, world_size, checksums=checksums)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {d.name}: {e}", CheckpointWarning, stacklevel=2)
            continue
        return d
    return None


def _earlier_hint(ckpt_dir: Path) -> str:
    """Advice naming the previous complete checkpoint, if the folder sits in a run layout."""
    try:
        step = step_of(ckpt_dir)
    except ValueError:
        return "Resume from an earlier checkpoint."
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        prev = latest_complete(Path(ckpt_dir).parent.parent, before_step=step)
    if prev is None:
        return "No earlier complete checkpoint exists: restart the run from scratch."
    return f"Resume from the previous complete checkpoint instead: {prev}"


def load_rank_state(ckpt_dir: Path, rank: int, expected_sha256: str | None = None) -> dict:
    """Verify ``rank{rank}.pt`` against its checksum (from meta.json unless given) and load
    it on CPU."""
    ckpt_dir = Path(ckpt_dir)
    path = rank_file(ckpt_dir, rank)
    try:
        if expected_sha256 is None:
            meta = read_meta(ckpt_dir)
            expected_sha256 = meta["files"].get(path.name)
            if expected_sha256 is None:
                raise CheckpointError(
                    f"{ckpt_dir / META_NAME} lists no {path.name} "
                    f"(world size {meta.get('world_size')})"
                )
        problem = _check_file(path, expected_sha256)
        if problem:
            raise CheckpointError(f"{path} {problem}")
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # checksum matched, so the writer stored something unloadable
            raise CheckpointError(f"{path} cannot be loaded with weights_only=True: {e}") from e
    except CheckpointError as e:
        raise CheckpointError(
            f"cannot resume from {ckpt_dir.name}: {e}. {_earlier_hint(ckpt_dir)}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__qualname__}, expected a dict")
    return state


# ---------------------------------------------------------------- pruning


def prune(run_dir: Path, keep: int, *, checksums: bool = True) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; return the folders deleted.

    Incomplete or corrupt folders newer than the newest complete one are kept (they may still be
    being written); those older than it are deleted with the rest.
    """
    if keep < 1:
        raise ValueError(
            f"keep must be >= 1 (never delete the newest complete checkpoint), got {keep}"
        )
    ckpts = list_checkpoints(run_dir)
    kept: list[Path] = []
    newest_complete: int | None = None
    for i in range(len(ckpts) - 1, -1, -1):
        try:
            verify_checkpoint(ckpts[i], checksums=checksums)
        except CheckpointError:
            continue
        newest_complete = i if newest_complete is None else newest_complete
        kept.append(ckpts[i])
        if len(kept) == keep:
            break
    if newest_complete is None:
        return []  # nothing verifies: everything may be in progress or needed for forensics
    doomed = [d for d in ckpts[: newest_complete + 1] if d not in kept]
    for d in doomed:
        # Rename first (atomic) so a crash mid-delete never leaves a half-deleted step-* folder.
        trash = d.with_name(f".deleting-{d.name}-{os.getpid()}")
        os.replace(d, trash)
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        fsync_dir(Path(run_dir) / "checkpoints")
    return doomed


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Capture torch CPU, current CUDA device, numpy global and Python ``random`` RNG states
    (weights_only-safe)."""
    version, mt, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # uint32 words fit in int64
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    # Only the current device: get_rng_state_all() would create a context on every visible GPU.
    # is_initialized: a process that never touched CUDA has no CUDA stream to save, and calling
    # get_rng_state() before set_device() would open a context on GPU 0 from every rank.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore RNG states captured by :func:`rng_state`."""
    torch.set_rng_state(state["torch"].cpu())
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["bit_generator"],
            npst["keys"].numpy().astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
    )
    py = state["python"]
    random.setstate(
        (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
    )
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].cpu())
        else:
            warnings.warn(
                "checkpoint has a CUDA RNG state but CUDA is not available: not restored",
                stacklevel=2,
            )
