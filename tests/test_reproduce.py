"""Every row of `compare` carries the command that reruns it, and that command gives its loss."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from lowcomm.config import build_configs
from lowcomm.presets import preset_config
from lowcomm.train.summary import RunSummary

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
TINY = ["model=tiny", "batch_size=4", "seq_len=32", "eval_batches=2"]


def _summary(strategy: str, values: dict, workers: int = 2, **fields) -> RunSummary:
    """A summary whose config is built the way the trainer builds it."""
    config = build_configs(values, sync=preset_config(strategy, workers=workers)).flat()
    return RunSummary(strategy=strategy, name="row", workers=workers, config=config, **fields)


@pytest.mark.parametrize(
    "strategy,values",
    [
        ("ddp", {"inner_lr": 0.006}),
        ("loco", {"loco_beta": 0.5, "loco_bits": 2}),
        ("diloco", {"sync_every": 30, "outer_lr": 0.4}),
        ("streaming", {"blocks_per_fragment": 1, "overlap": 2}),
        ("sparseloco", {"density": "1/32", "error_decay": 0.9}),
        ("co2", {"co2_keep": 0.5, "sync_every": 12}),
        ("diloco", {"rounds": "quorum", "quorum": 2, "grace": 0.25}),
    ],
)
def test_command_reads_back_to_the_same_configuration(strategy, values):
    s = _summary(strategy, values, workers=3)
    argv = shlex.split(s.command())
    assert argv[:6] == ["lowcomm", "train", "--strategy", strategy, "--workers", "3"]
    keys = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    # every setting is spelled out, not only the ones the user gave
    assert {"sync_every", "outer_lr", "inner_lr", "seed", "codec", "loco_beta"} <= set(keys)
    assert build_configs(keys, sync=preset_config(strategy, workers=3)).flat() == s.config


def test_a_shaped_row_is_rerun_by_compare_behind_the_same_link():
    s = _summary("diloco", {}, bandwidth="10mbit", topology="per-worker", seed=2)
    argv = shlex.split(s.command())
    assert argv[:2] == ["lowcomm", "compare"]
    assert argv[argv.index("--bandwidths") + 1] == "10mbit"
    assert argv[argv.index("--topology") + 1] == "per-worker"
    assert argv[argv.index("--seeds") + 1] == "2"


def test_the_command_is_derived_not_read_back():
    s = _summary("diloco", {})
    d = {**s.to_dict(), "command": "stale text"}
    again = RunSummary.from_dict(d)
    assert again.to_dict()["command"] == s.command() != "stale text"
    assert RunSummary(strategy="diloco").command() is None  # no config: nothing to rerun
    # an older summary lacking a key: today's default would stand in for it, so no command
    older = {k: v for k, v in s.config.items() if k != "co2_keep"}
    assert RunSummary(strategy="co2", config=older).command() is None


def test_the_command_names_the_device_the_run_used():
    s = _summary("diloco", {}, device="cuda:0")
    assert "device=cuda" in shlex.split(s.command())  # not `auto`, which picks another machine's
    assert "device=auto" in shlex.split(_summary("diloco", {}).command())


# by hand (-m slow), 15 s: the read-back test above pins the command to the run's configuration,
# and the pinned digests (test_pinned.py) pin that a configuration gives the same bits
@pytest.mark.slow
def test_rows_command_gives_the_rows_loss(tmp_path):
    """A real compare on gloo workers, then each row's command from results.json, run as is."""
    out = tmp_path / "cmp"
    # LoCo: a per-step strategy whose knobs live in the sync config (they were once left out);
    # the outer methods' configs read back in test_command_reads_back_to_the_same_configuration
    args = ["compare", "--strategies", "loco:loco_beta=0.5"]
    args += ["--workers", "2", "--steps", "12", "--out", str(out), "eval_every=6", *TINY]
    proc = subprocess.run(LOWCOMM + args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((out / "results.json").read_text())
    assert "Each row's run" in (out / "results.md").read_text()
    for row in rows:
        again = tmp_path / row["name"]
        argv = shlex.split(row["command"])
        argv[argv.index("--out") + 1] = str(again)
        assert "loco_beta=0.5" in argv and "progress=true" not in argv
        proc = subprocess.run(
            LOWCOMM + argv[1:] + ["progress=false"], capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, proc.stderr
        rerun = json.loads((again / "summary.json").read_text())
        assert rerun["final_val_loss"] == row["final_val_loss"], row["name"]
        assert rerun["config"]["device"] == row["device"] == "cpu"
        shown = {"progress", "device"}  # how it is shown; `auto` resolved to what it ran on
        assert {k: v for k, v in rerun["config"].items() if k not in shown} == {
            k: v for k, v in row["config"].items() if k not in shown
        }
