"""Shared test helpers: run a function on M real gloo worker processes."""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers fork from one server process that imported torch and lowcomm once per session (a spawned
# worker spends ~1.8 s importing them again: about a third of the default suite's time). The
# server starts no threads, so a fork from it is as clean as a spawn; each worker takes the
# test's environment as it is at the call, not as it was when the server started.
_PRELOAD = ["torch", "torch.distributed", "lowcomm", "lowcomm.engine", "lowcomm.train.loop"]


def _target(
    rank: int, world: int, port: int, fn, args: tuple, out_dir: str, env: dict[str, str]
) -> None:
    import torch.distributed as dist

    os.environ.clear()  # exactly the caller's environment, not the server's from its start
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from lowcomm.transport import shutdown

    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        shutdown()  # frees groups held by garbage cycles (a DDP hook's state) first


def run_workers(fn, world: int, *args, tmp_path: Path) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` real processes joined by gloo;
    results by rank."""
    import multiprocessing

    import torch.multiprocessing as mp

    out = tmp_path / f"workers-{fn.__name__}"
    out.mkdir(parents=True, exist_ok=True)
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    mp.start_processes(
        _target,
        args=(world, _free_port(), fn, args, str(out), dict(os.environ)),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture
def workers(tmp_path):
    """``workers(fn, M, *args)`` -> per-rank results of fn run on M gloo processes."""

    def run(fn, world, *args):
        return run_workers(fn, world, *args, tmp_path=tmp_path)

    return run
