"""The command line and the engine on a GPU (skipped where none is; `make gpu-check` runs them):
`train` for every strategy writes its summary and model, `make demo`'s comparison runs, two
workers share one GPU over gloo, a run resumes on the device, the own-loop engine and the codecs
run there (the codecs' device agreement: tests/test_codecs.py's cuda cases). Each `train`
is a real launch, as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--model", "small", "batch_size=4", "seq_len=64", "eval_batches=2", "progress=false"]


def _env() -> dict[str, str]:
    """This environment with the source tree first on the path (where the wheels it was given,
    torchft's, stay reachable)."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _lowcomm(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = _env()
    return subprocess.run(
        [sys.executable, "-m", "lowcomm.cli", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip


def _trained(out: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.pt").exists(), proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"].startswith("cuda")
    assert summary["final_val_loss"] == summary["final_val_loss"]  # finite, not NaN
    return summary


@pytest.mark.parametrize("strategy", ["ddp", "loco", "diloco", "streaming", "sparseloco", "co2"])
def test_train_every_strategy_on_the_gpu(strategy, tmp_path):
    out = tmp_path / strategy
    proc = _lowcomm("train", "--strategy", strategy, "--workers", "1", "--steps", "30",
                    "--out", str(out), *SMALL, "device=cuda", "sync_every=10")  # fmt: skip
    summary = _trained(out, proc)
    assert summary["inner_steps"] == 30


@pytest.mark.parametrize("strategy", ["streaming", "sparseloco", "co2"])
def test_the_sync_state_in_host_memory_trains_on_the_gpu(strategy, tmp_path):
    """``state_device=cpu``: the global copy in pinned host memory, the model on the GPU, its
    transfers in on a copy stream; it ends where the same run with its state on the GPU does
    (the outer step's arithmetic is the same; a transfer read before it landed would not)."""
    losses = []
    for state in ("cpu", "model"):
        out = tmp_path / f"{strategy}-{state}"
        proc = _lowcomm("train", "--strategy", strategy, "--workers", "1", "--steps", "30",
                        "--out", str(out), *SMALL, "device=cuda", "sync_every=10",
                        f"state_device={state}")  # fmt: skip
        summary = _trained(out, proc)
        assert summary["inner_steps"] == 30
        losses.append(summary["final_val_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=0.02)


def test_a_hugging_face_model_trains_on_the_gpu(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    proc = _lowcomm("train", "--strategy", "streaming", "--workers", "1", "--steps", "20",
                    "--out", str(out), "--model", "hf:llama", "batch_size=4", "seq_len=64",
                    "eval_batches=2", "progress=false", "device=cuda", "sync_every=10")  # fmt: skip
    _trained(out, proc)
    assert (out / "hf" / "config.json").exists()


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco", "ddp"])
def test_two_workers_share_one_gpu(strategy, tmp_path):
    out = tmp_path / strategy
    proc = _lowcomm("train", "--strategy", strategy, "--workers", "2", "--steps", "20",
                    "--out", str(out), *SMALL, "device=cuda:0", "sync_every=10")  # fmt: skip
    summary = _trained(out, proc)
    assert summary["workers"] == 2 and summary["bytes_sent_per_worker"] > 0
    assert "Duplicate GPU" not in proc.stderr


def test_the_demo_comparison_runs_on_the_gpu(tmp_path):
    """`make demo`'s own command (the Makefile's strategies and settings), fewer steps."""
    text = (ROOT / "Makefile").read_text()
    strategies = text.split("DEMO_STRATEGIES := ", 1)[1].split("\n", 1)[0].strip()
    out = tmp_path / "demo"
    proc = _lowcomm("compare", "--strategies", strategies, "--model", "small", "--workers", "2",
                    "--steps", "50", "--out", str(out), "batch_size=8", "eval_every=50",
                    "eval_batches=8", "warmup_steps=20", timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 6 and all(r["device"].startswith("cuda") for r in rows)


def test_a_run_resumes_on_the_gpu(tmp_path):
    out = tmp_path / "r"
    args = ["--workers", "1", "--out", str(out), *SMALL, "device=cuda", "sync_every=8"]
    proc = _lowcomm("train", "--strategy", "sparseloco", "--steps", "16", *args,
                    "checkpoint_every=8")  # fmt: skip
    _trained(out, proc)
    proc = _lowcomm("train", "--resume", str(out), "steps=24")
    summary = _trained(out, proc)
    assert summary["inner_steps"] == 24


def _torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        pytest.skip("needs torchft (make gpu-wheels carries it to a GPU machine)")


def test_elastic_sites_share_the_gpu(tmp_path):
    _torchft()
    out = tmp_path / "e"
    proc = _lowcomm("train", "--strategy", "diloco", "--workers", "2", "--steps", "20",
                    "--out", str(out), *SMALL, "device=cuda", "sync_every=5", "elastic=true",
                    "min_workers=1")  # fmt: skip
    summary = _trained(out, proc)
    assert summary["workers"] == 2


def test_sites_launched_on_their_own_on_the_gpu(tmp_path):
    """Two sites, two commands, one lighthouse: both finish with the same model."""
    _torchft()
    from lowcomm.train.ports import free_port

    port = free_port(host="")
    env = _env()
    cli = [sys.executable, "-m", "lowcomm.cli"]
    lighthouse = subprocess.Popen(
        [*cli, "lighthouse", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert "lighthouse at" in lighthouse.stdout.readline()
        site = [*cli, "train", "--strategy", "sparseloco", "--steps", "20", *SMALL, "device=cuda",
                "sync_every=5", "elastic=true", "sites=2", "min_workers=2",
                f"lighthouse=127.0.0.1:{port}"]  # fmt: skip
        procs = [subprocess.Popen([*site, f"site={i}", "--out", str(tmp_path / f"s{i}")],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]  # fmt: skip
        said = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in said]
    finally:
        lighthouse.kill()
    models = [torch.load(tmp_path / f"s{i}" / "model.pt") for i in range(2)]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
