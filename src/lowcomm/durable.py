"""Durable files: a write goes to a temp file in the same folder, is fsynced and renamed over
its name, then the folder is fsynced, so a crash leaves the old file or the new one, never a torn
one; and the check that a state loads with ``torch.load(weights_only=True)`` before it is
written. Shared by the trainer's checkpoints and the Hugging Face Trainer's engine files."""

from __future__ import annotations

import collections
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

_CHUNK = 8 << 20

# Exactly these types load under torch.load(weights_only=True) on every torch we support (>= 2.6).
# Exact type checks, not isinstance: np.float64 subclasses float and IntEnum subclasses int, yet
# both pickle as foreign globals that weights_only refuses.
_SCALARS = (str, int, float, bool, type(None))
_ATOMS = _SCALARS + (torch.dtype, torch.device)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_MAPPINGS = (dict, collections.OrderedDict)  # model.state_dict() is an OrderedDict
_SEQUENCES = (list, tuple, torch.Size)


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the renames and new entries in it are on disk."""
    # The rename itself is only durable once the directory entry is on disk.
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> None:
    """Create ``path`` (and its parents) with its entry made durable."""
    path = Path(path)
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    fsync_dir(path.parent)  # make the new folder's entry durable


def atomic_write(path: Path, write_fn: Callable[[IO[bytes]], Any]) -> str:
    """Write via ``write_fn(fileobj)`` to a temp file, fsync, hash, rename over ``path``;
    return sha256."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        # Hash what actually reached the file, before it becomes visible under its real name.
        digest = sha256_file(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)
    return digest


def sha256_file(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _path_str(path: list[Any]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def check_weights_only_safe(state: Any) -> None:
    """Raise TypeError (naming the key path) unless ``state`` loads with ``weights_only=True``."""
    active: set[int] = set()  # ids on the current path: catches cycles, allows shared leaves

    def walk(obj: Any, path: list[Any]) -> None:
        t = type(obj)
        if t in _TENSORS or t in _ATOMS:
            return
        if t in _MAPPINGS or t in _SEQUENCES:
            if id(obj) in active:
                raise TypeError(f"{_path_str(path)} contains itself (reference cycle)")
            active.add(id(obj))
            if t in _MAPPINGS:
                for k, v in obj.items():
                    if type(k) not in _SCALARS:
                        raise TypeError(
                            f"{_path_str(path)} has a key of type "
                            f"{t.__module__}.{type(k).__qualname__} ({k!r}); "
                            "only str/int/float/bool/None keys load with weights_only=True"
                        )
                    walk(v, path + [k])
            else:
                for i, v in enumerate(obj):
                    walk(v, path + [i])
            active.discard(id(obj))
            return
        raise TypeError(
            f"{_path_str(path)} is a {t.__module__}.{t.__qualname__}, which "
            "torch.load(weights_only=True) cannot load; "
            "store tensors, str/int/float/bool/None and lists/tuples/dicts of those "
            "(e.g. obj.state_dict() instead of obj, .item() or torch.tensor(...) for numpy values)"
        )

    walk(state, [])
