"""The command line: summary fields, and bad input gives one line and exit status 2."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
SUMMARY_FIELDS = [
    "strategy",
    "workers",
    "params",
    "tokens",
    "inner_steps",
    "final_val_loss",
    "bytes_sent_per_worker",
    "bytes_received_per_worker",
    "payload_bytes_per_worker",
    "ddp_fp32_bytes_per_worker",
    "control_bytes_per_worker",
    "wall_s",
    "compute_s",
    "blocked_s",
    "compute_utilization",
    "peak_rss_bytes",
    "seed",
    "config",
    "torch_version",
    "git_rev",
]
TINY = ["--model", "tiny", "batch_size=4", "seq_len=32", "eval_batches=2", "progress=false"]


def _run(args, timeout=180):
    return subprocess.run(LOWCOMM + args, capture_output=True, text=True, timeout=timeout)


def _assert_user_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    for w in words:
        assert w in err[0], err[0]


def test_train_writes_summary_with_every_field(tmp_path):
    out = tmp_path / "run"
    proc = _run(
        [
            "train",
            "--strategy",
            "diloco",
            "--workers",
            "2",
            "--steps",
            "12",
            "--out",
            str(out),
            "sync_every=4",
            "eval_every=6",
            *TINY,
        ]
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    for f in SUMMARY_FIELDS:
        assert f in s, f
    M, n = s["workers"], s["params"]
    assert s["tokens"] == 12 * 4 * 32 * M
    # bytes are the sizes of the tensors sent: 3 FP32 all-reduces of the whole model + its flag
    assert s["payload_bytes_per_worker"] == 3 * 4 * (n + 1)
    assert s["bytes_sent_per_worker"] == 3 * round(2 * (M - 1) / M * 4 * (n + 1))
    assert s["ddp_fp32_bytes_per_worker"] == int(12 * 2 * (M - 1) / M * 4 * n)
    assert 0 < s["compute_utilization"] <= 1.0
    assert abs(s["compute_s"] + s["blocked_s"] - s["wall_s"]) <= 0.05 * s["wall_s"] + 0.05
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in records) and records[-1].get("final")
    assert not (out / "workers.json").exists()  # only while the run is alive


def _refused(capsys, args, *words):
    """``lowcomm ARGS`` run in this process (see conftest's ``no_start``): exit status 2 and
    one line on stderr naming each of ``words``."""
    from lowcomm import cli

    code = cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    for w in words:
        assert w in err[0], err[0]


BAD_INPUT = [
    (["train", "--strategy", "dilloco"], ["unknown strategy", "diloco"]),
    (["train", "--strategy", "diloco", "sync_evry=3"], ["unknown config key", "sync_every"]),
    (["train", "--strategy", "diloco", "sync_every=0"], ["sync_every", ">= 1"]),
    (["train", "--strategy", "diloco", "--workers", "0"], ["--workers", ">= 1"]),
    (
        ["train", "--strategy", "diloco", "data=/nonexistent/corpus.txt"],
        ["/nonexistent/corpus.txt", "does not exist"],
    ),
    (["train", "--strategy", "diloco", "sync_every=abc"], ["sync_every", "not a valid int"]),
    (["train", "--strategy", "diloco", "--model", "huge"], ["unknown model preset", "small"]),
    (["train", "--strategy", "diloco", "--model", "124m"], ["now '85m'", "--model 85m"]),
    (["compare", "--strategies", "ddp,nope"], ["unknown strategy"]),
    (["compare", "--strategies", "sparseloco:density"], ["not key=value"]),
    (["train"], ["--strategy"]),
]


def _with_out(args, tmp_path):
    if args[0] in ("train", "compare") and len(args) > 1:
        return args + ["--out", str(tmp_path / "o")]
    return args


def test_bad_input_from_the_real_command_is_one_line_exit_2_no_traceback(tmp_path):
    """The one case run as the user runs it (`python -m lowcomm.cli`, its own process): the
    process's exit status is 2 and stderr holds one line, no traceback. The other refusals run
    in this process (the same main(), ~2.5 s of imports each saved)."""
    args, words = BAD_INPUT[0]
    _assert_user_error(_run(_with_out(args, tmp_path)), *words)


@pytest.mark.parametrize("args,words", BAD_INPUT)
def test_bad_input_one_line_exit_2(tmp_path, capsys, no_start, args, words):
    _refused(capsys, _with_out(args, tmp_path), *words)


def test_unwritable_output_folder(tmp_path, capsys, no_start):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a folder should be: unwritable even for root
    _refused(
        capsys,
        ["train", "--strategy", "diloco", "--out", str(blocker / "run")],
        "cannot write to output folder",
    )


def test_port_in_use(tmp_path, capsys, no_start):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = ["train", "--strategy", "diloco", "--port", str(port), "--out", str(tmp_path / "o")]
        _refused(capsys, [*args, *TINY], f"port {port} is in use")


def test_missing_config_file(tmp_path, capsys, no_start):
    _refused(
        capsys,
        ["train", "--strategy", "diloco", "--config", str(tmp_path / "no.toml"),
         "--out", str(tmp_path / "o")],
        "no.toml",
        "not found",
    )  # fmt: skip


def test_toml_config(tmp_path, capsys, no_start):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[sync]\nsync_every = 0\n")
    _refused(
        capsys,
        ["train", "--strategy", "diloco", "--config", str(cfg), "--out", str(tmp_path / "o")],
        "sync_every",
    )
