"""Start the workers of a run: M local processes through torch's elastic launcher, or, under
``torchrun``, the world torchrun already made (so multi-node needs no extra code)."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from ..peers import torchft as torchft_peer
from ..config import ConfigError, SyncConfig, TrainConfig


class LaunchError(RuntimeError):
    """A worker failed; the message names the rank and the cause."""

    def __init__(self, message: str, exitcode: int = 1) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def under_torchrun() -> bool:
    """True when this process is one worker of a world started by torchrun (or similar)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOWCOMM_LAUNCHED" not in os.environ


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(port: int) -> None:
    """ConfigError when ``port`` cannot be bound on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(f"port {port} is in use: pass another --port or omit it to pick a free one") from None


def _entry(strategy: str, sync_cfg: SyncConfig, cfg: TrainConfig, out_dir: str, name: str | None,
           resume: str | None) -> Any:
    os.environ["LOWCOMM_LAUNCHED"] = "1"
    from .loop import run_worker

    try:
        return run_worker(strategy, sync_cfg, cfg, out_dir, name, resume)
    except (ConfigError, FileNotFoundError) as e:
        # a user error found inside a worker: one line, status 2, no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def launch(strategy: str, sync_cfg: SyncConfig, cfg: TrainConfig, out_dir: str | Path,
           workers: int, port: int | None = None, name: str | None = None,
           resume: str | None = None) -> dict[str, Any] | None:
    """Run a training job; returns rank 0's summary (None on other ranks under torchrun).

    ``resume`` is a checkpoint folder (from :func:`find_resume`) to continue from.
    """
    if strategy == torchft_peer.STRATEGY:
        torchft_peer.check_config(sync_cfg, cfg.checkpoint_every, resume)
    if under_torchrun():
        from .loop import run_worker

        return run_worker(strategy, sync_cfg, cfg, out_dir, name, resume)
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if port is not None:
        check_port(port)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not os.environ.get("LOWCOMM_DEBUG"):
        # we report a failed worker in one line ourselves; LOWCOMM_DEBUG=1 shows torch's logs
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=uuid.uuid4().hex[:12],
                      rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port or free_port()}",
                      max_restarts=0, monitor_interval=0.2, start_method="spawn")
    try:
        results = elastic_launch(lc, _entry)(strategy, sync_cfg, cfg, str(out_dir), name, resume)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        if failure.exitcode == 2:
            raise LaunchError(f"worker {rank} stopped on a user error (above)", 2) from None
        what = (f"was lost (killed by signal {-failure.exitcode})" if failure.exitcode < 0
                else f"failed (exit code {failure.exitcode})")
        raise LaunchError(f"worker {rank} (pid {failure.pid}) {what}: {msg}; the other workers were "
                          f"stopped. {_last_checkpoint_hint(out_dir)}") from None
    return results.get(0)


def _last_checkpoint_hint(out_dir: str | Path) -> str:
    from .. import checkpoint as ckpt

    try:
        last = ckpt.latest_complete(Path(out_dir), checksums=False)
    except Exception:  # the hint must never hide the real failure
        last = None
    if last is None:
        return "No checkpoint was written (set checkpoint_every=N to make runs resumable)."
    return f"Last checkpoint: {last} (continue with `lowcomm train --resume {out_dir}`)."


def find_resume(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint of a run folder and its saved run config, or ConfigError."""
    import warnings

    from .. import checkpoint as ckpt

    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"--resume {run}: no such run folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = ckpt.latest_complete(run)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if last is None:
        raise ConfigError(f"--resume {run}: no complete checkpoint in {run / 'checkpoints'} "
                          f"(runs write them with checkpoint_every=N)")
    meta = ckpt.read_meta(last)
    return last, meta
