"""Backends by rule (gloo on the CPU; NCCL for CUDA tensors where each rank owns a GPU; gloo
where ranks share one) and the GPU shapes refused before any worker starts, tested on the CPU
with stand-in GPU counts; a worker's unexpected failure names the file that holds its stack."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowcomm.config import ConfigError, TrainConfig
from lowcomm.train import entry, launch
from lowcomm.train.run import backend_for


@pytest.mark.parametrize(
    "device,local,gpus,backend",
    [
        ("cpu", 4, 0, "gloo"),
        ("cuda", 1, 1, "cpu:gloo,cuda:nccl"),  # the world of one: CPU tensors still have gloo
        ("cuda", 8, 8, "cpu:gloo,cuda:nccl"),
        ("cuda", 2, 1, "gloo"),  # two workers on one GPU: NCCL would refuse them
        ("cuda", 9, 8, "gloo"),
    ],
)
def test_the_backend_follows_who_owns_a_gpu(device, local, gpus, backend):
    assert backend_for(device, local, gpus) == backend


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(device="cuda", **kw)


def test_ranks_inside_a_worker_sharing_a_gpu_are_refused_naming_a_shape_that_runs(monkeypatch):
    monkeypatch.setattr("lowcomm.train.run.gpus_for", lambda device: 1)
    with pytest.raises(ConfigError) as e:
        launch.check_gpu_shape(_cfg(ranks_per_worker=2), ranks=4)
    said = str(e.value)
    assert "\n" not in said and "4 ranks would share this machine's 1 GPU" in said
    assert "ranks_per_worker=1" in said  # the shape that runs
    launch.check_gpu_shape(_cfg(ranks_per_worker=1), ranks=4)  # workers of one rank share
    monkeypatch.setattr("lowcomm.train.run.gpus_for", lambda device: 4)
    launch.check_gpu_shape(_cfg(ranks_per_worker=2), ranks=4)  # a GPU per rank


def test_the_refusal_comes_before_any_worker_starts(monkeypatch, tmp_path, capsys):
    from lowcomm.cli import main

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("lowcomm.train.launch._run_local", lambda *a: pytest.fail("started"))
    code = main(["train", "--strategy", "diloco", "--workers", "2", "--model", "tiny",
                 "--steps", "2", "--out", str(tmp_path / "o"), "ranks_per_worker=2",
                 "device=cuda"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ranks_per_worker=2 runs FSDP2" in err[0]


def test_a_workers_unexpected_failure_names_the_file_with_its_stack(tmp_path, monkeypatch):
    def summarize():
        raise RuntimeError("No backend type associated with device type cpu")

    monkeypatch.setenv("LOWCOMM_LAUNCHED", "1")  # run_entry sets it: restored after the test
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(RuntimeError):
            entry.run_entry(str(tmp_path), 1, summarize)
    finally:
        signal.signal(signal.SIGINT, handler)
    stack = (tmp_path / "traceback-rank1.txt").read_text()
    assert stack.startswith("Traceback") and "in summarize" in stack
    # what torch's launcher says without @record, and what the user reads instead
    failure = SimpleNamespace(exitcode=1, pid=7, message="To enable traceback see: https://...")
    err = launch._worker_failure(SimpleNamespace(get_first_failure=lambda: (1, failure)), tmp_path)
    said = str(err)
    assert said.startswith("worker 1 (pid 7) failed (exit code 1): RuntimeError: No backend type")
    assert f"(its stack: {tmp_path / 'traceback-rank1.txt'})" in said and "\n" not in said
    assert "To enable traceback" not in said


# what sitecustomize plants in every process (so the product carries no test hook): a fixed
# world's collective that raises; an elastic site's optimizer step that raises (its failed
# collectives would be retried on a new quorum, not raised)
PLANTS = {
    "fixed": ("import torch.distributed as dist\n"
              "def _broken(*args, **kwargs):\n"
              "    raise RuntimeError('planted: no backend for this tensor')\n"
              "dist.all_reduce = _broken\n", [], "traceback-rank0.txt"),
    "elastic": ("import torch\n"
                "def _broken(*args, **kwargs):\n"
                "    raise RuntimeError('planted: no backend for this tensor')\n"
                "torch.optim.AdamW.step = _broken\n", ["elastic=true", "min_workers=1"],
                "traceback-rank0.txt"),
}  # fmt: skip


@pytest.mark.parametrize("shape", ["fixed", "elastic"])
def test_a_real_workers_failure_reaches_the_user_with_its_stack(tmp_path, shape):
    """A worker process that fails on something other than a user error: the launcher's
    one error line ends with the failure and names the file with its stack."""
    import os
    import subprocess
    import sys

    if shape == "elastic":
        pytest.importorskip("torchft")
    code, extra, stack = PLANTS[shape]
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(code)
    src = Path(__file__).resolve().parent.parent / "src"
    env = {**os.environ, "PYTHONPATH": f"{plant}{os.pathsep}{src}"}
    out = tmp_path / "run"
    workers = "2" if shape == "elastic" else "1"
    proc = subprocess.run(
        [sys.executable, "-m", "lowcomm.cli", "train", "--strategy", "diloco", "--workers",
         workers, "--model", "tiny", "--steps", "2", "--out", str(out), "batch_size=2",
         "seq_len=16", "eval_batches=1", "progress=false", "sync_every=1", *extra],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "RuntimeError: planted: no backend for this tensor" in line, proc.stderr
    assert f"(its stack: {out / stack})" in line, line
    assert "_broken" in (out / stack).read_text() and "Traceback" not in proc.stderr


def test_the_error_line_names_the_killed_worker_not_the_peer_that_failed_after_it(tmp_path):
    """A worker killed by a signal makes its peers fail in their next collective, sometimes
    before the launcher sees the kill: the line names the killed one (the cause)."""
    peer = SimpleNamespace(exitcode=1, pid=7, message="Connection closed by peer")
    killed = SimpleNamespace(exitcode=-9, pid=8, message="Signal 9 (SIGKILL) received")
    failed = SimpleNamespace(
        failures={0: peer, 1: killed},
        get_first_failure=lambda: (0, peer),  # torch's pick
    )
    said = str(launch._worker_failure(failed, tmp_path))
    assert said.startswith("worker 1 (pid 8) was lost (killed by signal 9)"), said
