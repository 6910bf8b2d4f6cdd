"""Checkpoint, kill a worker, resume: the resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
COMMON = [
    "--model",
    "tiny",
    "--steps",
    "40",
    "batch_size=4",
    "seq_len=32",
    "eval_batches=2",
    "eval_every=0",
    "progress=false",
    "checkpoint_every=8",
    "timeout_s=30",
]


# a slow link for the run a kill lands in (each collective of its syncs waits first); it only
# sleeps, so the run trains the same numbers
SLOW = ["--faults", "slowlink:0x0.15,slowlink:1x0.15"]


def _train(args, **kw):
    return subprocess.run(
        LOWCOMM + ["train", *args], capture_output=True, text=True, timeout=300, **kw
    )


def _kill_after_checkpoint(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    """Run ``lowcomm train ARGS``, SIGKILL worker 1 once the step-16 checkpoint exists."""
    proc = subprocess.Popen(
        LOWCOMM + ["train", *args, *SLOW], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    meta = out / "checkpoints" / "step-000000016" / "meta.json"
    while not meta.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    workers = json.loads((out / "workers.json").read_text())
    victim = next(w for w in workers if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize(
    "strategy,extra",
    [
        # 26 s, by hand (-m slow) like the rest: a resume after a lost worker runs by default
        # in test_elastic_cli (fewer than min_workers), test_own_loop and test_pinned
        pytest.param("diloco", ["sync_every=4"], marks=pytest.mark.slow),
        pytest.param("ddp", [], marks=pytest.mark.slow),
        pytest.param("loco", [], marks=pytest.mark.slow),
        # results in flight at the checkpoint (tau = 1; CO2's whole round) are stored as pending
        pytest.param(
            "streaming", ["sync_every=4", "overlap=1", "alpha=0.5"], marks=pytest.mark.slow
        ),
        pytest.param("co2", ["sync_every=4"], marks=pytest.mark.slow),
        pytest.param("sparseloco", ["sync_every=4"], marks=pytest.mark.slow),  # error buffers
    ],
)
def test_kill_worker_then_resume_is_bit_identical(tmp_path, strategy, extra):
    full, broken = tmp_path / "full", tmp_path / "broken"
    # the reference needs no slow link (it only sleeps): only the kill does
    ref = _train(["--strategy", strategy, "--workers", "2", "--out", str(full), *COMMON, *extra])
    assert ref.returncode == 0, ref.stderr

    dead = _kill_after_checkpoint(
        broken, ["--strategy", strategy, "--workers", "2", "--out", str(broken), *COMMON, *extra]
    )
    assert dead.returncode != 0
    # the launcher saw the kill itself and stopped the others (not their collective's timeout)
    assert "worker 1" in dead.stderr and "killed by signal 9" in dead.stderr, dead.stderr
    assert "worker 1" in dead.stderr and "Last checkpoint" in dead.stderr, dead.stderr
    assert "Traceback" not in dead.stderr.splitlines()[-1]

    res = _train(["--resume", str(broken)])
    assert res.returncode == 0, res.stderr
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((broken / "summary.json").read_text())
    assert a["final_val_loss"] == b["final_val_loss"]
    ma = torch.load(full / "model.pt", weights_only=True)
    mb = torch.load(broken / "model.pt", weights_only=True)
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert a["bytes_sent_per_worker"] == b["bytes_sent_per_worker"]
    # checkpoints and the restart are not training time: compute never exceeds wall
    assert 0 < b["compute_utilization"] <= 1 and b["compute_s"] <= b["wall_s"]


@pytest.mark.slow
def test_corrupt_checkpoint_refused_previous_used(tmp_path):
    out = tmp_path / "run"
    args = [
        "--strategy",
        "diloco",
        "--workers",
        "2",
        "--out",
        str(out),
        *COMMON,
        "sync_every=4",
        "--steps",
        "16",
    ]
    assert _train(args).returncode == 0
    last = out / "checkpoints" / "step-000000016" / "rank1.pt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    last.write_bytes(bytes(data))
    res = _train(["--resume", str(out), "steps=24"])
    assert res.returncode == 0, res.stderr
    assert "step-000000016" in res.stderr  # named as skipped
    assert "step-000000008" in res.stdout  # resumed from the previous good one
    # truncated too: both newest are bad now, the run still finds a good one or says so clearly
    first = out / "checkpoints" / "step-000000008" / "rank0.pt"
    first.write_bytes(first.read_bytes()[:100])
    res = _train(["--resume", str(out)])
    assert "Traceback" not in res.stderr
