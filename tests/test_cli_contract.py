"""The command line a user can trust: existing runs, resume conflicts, Ctrl-C, bad flags,
errors found before workers start, help and version, provenance, report grouping, logging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lowcomm import cli
from lowcomm.config import build_configs
from lowcomm.presets import preset_config
from lowcomm.train import checkpoint as ckpt

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
TINY = ["--model", "tiny", "batch_size=2", "seq_len=16", "eval_batches=2", "progress=false"]


@pytest.fixture
def launched(monkeypatch):
    """Replace the launch of workers: record its arguments, train nothing."""
    import lowcomm.train.launch as launch

    calls = []

    def fake(spec, workers, port=None, on_checked=None):
        if on_checked is not None:
            on_checked()
        calls.append(
            {
                "strategy": spec.strategy.name,
                "sync": spec.sync,
                "train": spec.train,
                "out": spec.out,
                "workers": workers,
                "resume": spec.resume,
            }
        )

    monkeypatch.setattr(launch, "launch", fake)
    return calls


def _one_line_error(capsys, code, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for w in words:
        assert w in err[0], err[0]


def _old_run(out: Path) -> None:
    (out / "checkpoints" / "step-000000008").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "model.pt").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")


def test_existing_run_folder_refused_unless_overwrite(tmp_path, capsys, launched):
    out = tmp_path / "run"
    _old_run(out)
    code = cli.main(["train", "--strategy", "diloco", "--out", str(out), *TINY])
    _one_line_error(capsys, code, f"--resume {out}", "--overwrite")
    assert not launched and (out / "model.pt").read_bytes() == b"old"

    assert cli.main(["train", "--strategy", "diloco", "--out", str(out), "--overwrite", *TINY]) == 0
    assert len(launched) == 1
    assert not (out / "checkpoints").exists() and not (out / "model.pt").exists()
    assert not (out / "summary.json").exists()
    assert (out / "notes.txt").read_text() == "mine"  # only what a run writes is removed


def test_overwrite_keeps_the_old_run_when_the_new_one_is_refused(tmp_path, capsys, no_workers):
    out = tmp_path / "run"
    _old_run(out)
    code = cli.main(
        [
            "train",
            "--strategy",
            "streaming",
            "--out",
            str(out),
            "--overwrite",
            *TINY,
            "blocks_per_fragment=0",
            "fragments=9",
        ]
    )
    _one_line_error(capsys, code, "fragments=9")
    assert (out / "model.pt").read_bytes() == b"old" and (out / "checkpoints").is_dir()


def _saved_run(out: Path, strategy: str, **values) -> None:
    """A run folder with one complete checkpoint whose meta records the run's settings."""
    import dataclasses

    configs = build_configs({"model": "tiny", **values}, sync=preset_config(strategy))
    run = {
        "strategy": strategy,
        "name": None,
        "sync": dataclasses.asdict(configs.sync),
        "train": dataclasses.asdict(configs.train),
        "membership": dataclasses.asdict(configs.membership),
    }
    d = ckpt.checkpoint_dir(out, 8)
    shas = [ckpt.save_rank_state(d, r, {"step": 8}) for r in range(2)]
    ckpt.finalize(d, step=8, world_size=2, checksums=shas, config=run, extra={"run": run})


def test_resume_refuses_another_strategy_or_changed_settings(tmp_path, capsys, launched):
    out = tmp_path / "run"
    _saved_run(out, "diloco", sync_every=4)
    code = cli.main(["train", "--resume", str(out), "--strategy", "sparseloco"])
    _one_line_error(capsys, code, "--strategy diloco", "sparseloco")
    code = cli.main(["train", "--resume", str(out), "sync_every=8"])
    _one_line_error(capsys, code, "sync_every (saved 4, given 8)")
    code = cli.main(["train", "--resume", str(out), "--model", "small"])
    _one_line_error(capsys, code, "model (saved 'tiny', given 'small')")
    assert not launched
    # the same strategy, and run-length settings, are fine
    assert cli.main(["train", "--resume", str(out), "--strategy", "diloco", "steps=40"]) == 0
    (call,) = launched
    assert call["strategy"] == "diloco" and call["train"].steps == 40
    assert call["sync"].sync_every == 4 and call["resume"].endswith("step-000000008")


def test_a_run_saved_before_a_knob_existed_resumes_with_its_old_behaviour(
    tmp_path, capsys, launched
):
    """co2_keep came after CO2 runs kept all of their round (1.0): such a checkpoint resumes
    with 1.0, not the preset's 0.5, and asking for 0.75 is a changed setting."""
    out = tmp_path / "run"
    _saved_run(out, "co2", sync_every=4)
    meta_path = next((out / "checkpoints").glob("step-*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["run"]["sync"]["co2_keep"]  # as written before the knob existed
    meta_path.write_text(json.dumps(meta))
    assert cli.main(["train", "--resume", str(out)]) == 0
    (call,) = launched
    assert call["sync"].co2_keep == 1.0 and preset_config("co2").co2_keep == 0.5
    code = cli.main(["train", "--resume", str(out), "co2_keep=0.75"])
    _one_line_error(capsys, code, "co2_keep (saved 1.0, given 0.75)")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--port", "99999"], ["--port", "99999", "1-65535"]),
        (["--port", "http"], ["--port", "not a port number"]),
        (["--workers", "x"], ["--workers", "invalid int"]),
        (["--steps", "1.5"], ["--steps"]),
    ],
)
def test_bad_flags_one_line(tmp_path, capsys, launched, args, words):
    code = cli.main(["train", "--strategy", "diloco", "--out", str(tmp_path / "o"), *args])
    _one_line_error(capsys, code, *words)


@pytest.fixture
def no_workers(monkeypatch):
    """Run the launcher's checks for real, but start no worker processes."""
    import lowcomm.train.launch as launch

    started = []
    monkeypatch.setattr(launch, "_run_local", lambda *a, **k: started.append(a))
    return started


def test_schedule_error_found_before_workers(tmp_path, capsys, no_workers):
    code = cli.main(
        [
            "train",
            "--strategy",
            "streaming",
            "--out",
            str(tmp_path / "o"),
            *TINY,
            "blocks_per_fragment=0",
            "fragments=9",
        ]
    )
    _one_line_error(capsys, code, "fragments=9", "blocks")
    assert not no_workers


def test_device_error_found_before_workers(tmp_path, capsys, no_workers):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    code = cli.main(
        ["train", "--strategy", "diloco", "--out", str(tmp_path / "o"), *TINY, "device=cuda"]
    )
    _one_line_error(capsys, code, "device=cuda", "device=cpu")
    assert not no_workers


def test_data_errors_found_before_workers(tmp_path, capsys, no_workers):
    garbage = tmp_path / "corpus.txt"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    code = cli.main(
        ["train", "--strategy", "diloco", "--out", str(tmp_path / "o"), *TINY, f"data={garbage}"]
    )
    _one_line_error(capsys, code, "not UTF-8 text", ".bin")
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(np.arange(4000, dtype=np.uint16).tobytes())
    code = cli.main(
        [
            "train",
            "--strategy",
            "diloco",
            "--out",
            str(tmp_path / "o"),
            *TINY,
            f"data={tokens}:int7",
        ]
    )
    _one_line_error(capsys, code, "unknown token dtype 'int7'", "uint16")
    assert not no_workers


def test_tiny_corpus_read_many_times_warns(tmp_path, capsys, no_workers):
    text = tmp_path / "small.txt"
    text.write_text("a short corpus line\n" * 150)  # 3 KB
    code = cli.main(
        [
            "train",
            "--strategy",
            "diloco",
            "--out",
            str(tmp_path / "o"),
            *TINY,
            f"data={text}",
            "--steps",
            "1000",
        ]
    )  # ~22 passes
    assert code == 0 and len(no_workers) == 1
    err = capsys.readouterr().err
    assert "warning:" in err and "times" in err and "bigger corpus" in err


def test_help_shows_defaults_and_version(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # independent of the terminal's width
    assert "required (unless --resume DIR)" in text and "lowcomm train --strategy NAME" in text
    assert "(default: 500" in text and "(default: runs/train)" in text
    assert "(default: a free one)" in text and "--overwrite" in text
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split("options:")[1].split())
    for flag in ("--strategies", "--seeds", "--bandwidth", "--bandwidths", "--topology"):
        entry = text[text.index(flag + " ") :].split(" --")[0]
        assert "default" in entry.split("config keys")[0], flag
    assert "local worker processes per run (default: 2)" in text
    assert cli.build_parser().parse_args(["compare"]).workers == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("lowcomm 0.")


def _summary(
    folder: Path, name: str, strategy: str, loss: float, seed: int, data: str, **config
) -> None:
    d = folder / name
    d.mkdir(parents=True)
    cfg = {"model": "tiny", "data": data, "steps": 30, "seed": seed, "sync_every": 10, **config}
    s = {
        "name": name,
        "strategy": strategy,
        "final_val_loss": loss,
        "bytes_sent_per_worker": 100,
        "ddp_fp32_bytes_per_worker": 1000,
        "wall_s": 3.0,
        "compute_utilization": 0.9,
        "workers": 2,
        "seed": seed,
        "config": cfg,
        "data": f"text file {data}",
    }
    (d / "summary.json").write_text(json.dumps(s))


def test_report_groups_only_runs_of_one_config_and_data(tmp_path):
    from lowcomm.lab.bench.compare import write_report

    _summary(tmp_path / "a", "diloco", "diloco", 2.0, 0, "x.txt")
    _summary(tmp_path / "b", "diloco", "diloco", 2.2, 1, "x.txt")  # a second seed
    _summary(tmp_path / "c", "diloco", "diloco", 5.0, 0, "other.txt")  # other data
    _summary(tmp_path / "d", "diloco", "diloco", 3.0, 0, "x.txt", sync_every=50)  # other H
    _summary(tmp_path / "a", "ddp", "ddp", 1.0, 0, "x.txt")
    _summary(tmp_path / "c", "ddp", "ddp", 4.0, 0, "other.txt")
    out = tmp_path / "r"
    write_report([tmp_path / k for k in "abcd"], out, command="lowcomm report a b c d")
    md = (out / "results.md").read_text()
    rows = {
        line.split("|")[1].strip(): line
        for line in md.splitlines()
        if line.startswith("| diloco") and line.count("|") == 7
    }
    # seeds 0 and 1 on x.txt: mean 2.1, against DDP on x.txt (1.0)
    assert "| 2 | 2.1000 | 0.2000 | 2.100 |" in rows["diloco"]
    # the other data and the other H are their own groups; other data meets its own DDP (4.0)
    assert "| 1 | 5.0000 | 0.0000 | 1.250 |" in rows["diloco (2)"]
    assert "| 1 | 3.0000 | 0.0000 | 3.000 |" in rows["diloco (3)"]


def test_results_md_carries_command_commit_and_date(tmp_path):
    from lowcomm.lab.bench.compare import write_report

    _summary(tmp_path / "a", "ddp", "ddp", 1.0, 0, "x.txt")
    write_report([tmp_path / "a"], tmp_path / "r", command="lowcomm report a")
    first = (tmp_path / "r" / "results.md").read_text().splitlines()[0]
    assert "`lowcomm report a`" in first and "commit " in first
    assert time.strftime("%Y-%m-%d", time.gmtime()) in first


def test_plain_progress_lines_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = subprocess.run(
        LOWCOMM
        + [
            "train",
            "--strategy",
            "diloco",
            "--workers",
            "2",
            "--steps",
            "4",
            "--out",
            str(out),
            *TINY,
            "progress=true",
            "log_every=2",
            "sync_every=2",
            "log=tensorboard",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )  # stderr is a pipe
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "step " in x and "tokens/s" in x]
    assert [x.split("step ")[1].split(":")[0] for x in lines] == ["2", "4"], proc.stderr
    assert "MB sent" in lines[0]
    assert proc.stderr.count("corpus: Python") == 1  # what the run trains on, said once
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (event_dir,) = {p.parent for p in (out / "tensorboard").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss/train", "bytes/sent_per_worker", "time/utilization"} <= set(tags)
    train = [r for r in records if "train_loss" in r]
    got = [(e.step, e.value) for e in acc.Scalars("loss/train")]
    assert got == [(r["step"], pytest.approx(r["train_loss"], rel=1e-6)) for r in train]
    sent = [e.value for e in acc.Scalars("bytes/sent_per_worker")]
    assert sent == [pytest.approx(r["bytes_sent"]) for r in train]
    util = [e.value for e in acc.Scalars("time/utilization")]
    assert util == [pytest.approx(r["compute_s"] / r["wall_s"], rel=1e-5) for r in train]
    assert all(0 < u <= 1 for u in util)


def test_ctrl_c_stops_cleanly_with_a_resume_hint(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        LOWCOMM
        + [
            "train",
            "--strategy",
            "diloco",
            "--workers",
            "2",
            "--steps",
            "5000",
            "--out",
            str(out),
            *TINY,
            "sync_every=4",
            "checkpoint_every=4",
            "eval_every=0",
            "--faults",  # a slow link (each collective waits first): Ctrl-C lands mid-run
            "slowlink:0x0.02,slowlink:1x0.02",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    meta = out / "checkpoints" / "step-000000004" / "meta.json"
    deadline = time.time() + 120
    while not (meta.exists() and (out / "workers.json").exists()):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    pids = [w["pid"] for w in json.loads((out / "workers.json").read_text())]
    proc.send_signal(signal.SIGINT)  # to the launcher only
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and "last checkpoint" in last, stderr
    assert f"resume with `lowcomm train --resume {out}`" in last
    assert not [pid for pid in pids if _alive(pid)]  # the workers are gone, not orphaned


def test_workers_leave_when_their_launcher_is_killed(tmp_path):
    """`kill -9` of `lowcomm train` itself: its workers leave too instead of training on as
    orphans (they were, for a while, when forked from a preloaded server rather than spawned)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*LOWCOMM, "train", "--strategy", "diloco", "--workers", "2", "--steps", "100000",
         "--out", str(out), *TINY, "sync_every=4", "eval_every=0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 120
    while not (out / "workers.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the workers never started"
        time.sleep(0.05)
    pids = [w["pid"] for w in json.loads((out / "workers.json").read_text())]
    proc.kill()
    proc.wait()
    deadline = time.time() + 60
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # not to leave them running past a failure
        os.kill(pid, 9)
    assert not left, f"workers {left} trained on after their launcher was killed"


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_user_error_in_every_worker_is_reported_once(tmp_path):
    from types import SimpleNamespace

    from lowcomm.train import launch

    for rank in range(3):  # what _entry leaves behind when each worker stops on the same error
        launch._error_file(tmp_path, rank).write_text("seq_len=9999 is longer than the corpus")
    failure = SimpleNamespace(exitcode=2, message="", pid=1)
    err = launch._worker_failure(SimpleNamespace(get_first_failure=lambda: (1, failure)), tmp_path)
    assert err.exitcode == 2 and str(err) == "seq_len=9999 is longer than the corpus"
    assert not list(tmp_path.glob(".error-rank*"))


def test_a_vanished_peer_under_torchrun_is_one_line_with_the_resume_hint(tmp_path, monkeypatch):
    from lowcomm.train.launch import peer_lost_message

    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:38535. This is typically caused by a remote worker crashing. GLHF!"
    )
    monkeypatch.delenv("LOWCOMM_LAUNCHED", raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    said = peer_lost_message(gloo, tmp_path)
    assert said is not None and "\n" not in said
    assert said.startswith("rank 3: a collective failed because another worker is gone")
    assert "(Connection closed by peer [127.0.0.1]:38535)" in said
    assert "No checkpoint was written" in said and "GLHF" not in said
    assert peer_lost_message(RuntimeError("shape mismatch"), tmp_path) is None  # a real bug
    # a rank of a site launched on its own (site=2): the site leaves, the same command again
    monkeypatch.setattr("lowcomm.train.launch._site_launched", 2)
    said = peer_lost_message(gloo, tmp_path)
    assert said is not None and said.startswith("site 2, rank 3: another rank of this site is gone")
    assert "the whole site leaves the run" in said and "--resume" not in said
    monkeypatch.setattr("lowcomm.train.launch._site_launched", None)
    monkeypatch.delenv("RANK")
    assert peer_lost_message(gloo, tmp_path) is None  # our own launcher names the lost worker
