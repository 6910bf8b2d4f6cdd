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
# torch._dynamo: what the first torch.optim optimizer a process makes imports (~0.5 s of CPU in
# every worker otherwise; importing it starts no thread either)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "lowcomm", "lowcomm.engine",
            "lowcomm.train.loop"]  # fmt: skip


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


def _site_log(folder: str | Path, pid: int) -> str:
    return os.path.join(folder, f"process-{pid}")


def _site_main(fn, kwargs: dict, logs: str, env: dict[str, str], hard_exit: bool) -> None:
    """In the forked process: the caller's environment, stdout and stderr into files, then
    ``fn(**kwargs)``; an exception is printed (its last line last) and exits 1, as a script's."""
    import traceback

    os.environ.clear()
    os.environ.update(env)
    log = _site_log(logs, os.getpid())
    for fd, suffix in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(log + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    try:
        fn(**kwargs)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if hard_exit:  # as the script does after its record is written: no native teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class SiteProcess:
    """``fn(**kwargs)`` in a process of its own forked from the preloaded server, not a fresh
    ``python site_script.py`` (which spends ~2 s importing torch first): the surface of
    subprocess.Popen that the site tests use (pid, poll, returncode, communicate, kill), its
    stdout and stderr read back from files in ``logs``. The environment is the caller's at the
    call (as Popen's is); ``hard_exit``: leave with os._exit(0) once fn returns, as
    rounds_site.py's script does."""

    def __init__(self, fn, kwargs: dict, logs: Path, env: dict[str, str] | None = None,
                 hard_exit: bool = False) -> None:  # fmt: skip
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        env = dict(os.environ) if env is None else env
        self._proc = ctx.Process(target=_site_main, args=(fn, kwargs, str(logs), env, hard_exit))
        self._proc.start()
        self.pid = self._proc.pid
        self._log = _site_log(logs, self.pid)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        import subprocess

        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"site process {self.pid}", timeout)
        said = [Path(self._log + s) for s in (".out", ".err")]
        return tuple(p.read_text(errors="replace") if p.exists() else "" for p in said)


@pytest.fixture
def no_start(monkeypatch):
    """For `lowcomm.cli.main([...])` run in this process (a refusal needs no process of its
    own: ~2.5 s of imports saved per case): every way the CLI starts workers or sites fails the
    test instead, and the launcher's module state is restored after it."""
    import lowcomm.train.join_site as join_site
    import lowcomm.train.launch as launch
    import lowcomm.train.loop as loop

    def started(*args, **kwargs):
        raise AssertionError("the command went on to start workers: it should have refused")

    for module, name in [(launch, "_run_local"), (launch, "run_sites"),
                         (join_site, "run_site"), (loop, "run_worker")]:  # fmt: skip
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(launch, "_site_launched", None)  # a site= refusal sets it first
    # a site's late refusals (its --replay) come after it set RUST_LOG: restored after the test
    monkeypatch.setenv("RUST_LOG", "")
    monkeypatch.delenv("RUST_LOG")


@pytest.fixture
def workers(tmp_path):
    """``workers(fn, M, *args)`` -> per-rank results of fn run on M gloo processes."""

    def run(fn, world, *args):
        return run_workers(fn, world, *args, tmp_path=tmp_path)

    return run
