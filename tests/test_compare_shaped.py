"""`lowcomm compare --bandwidth`: workers behind a kernel-shaped link, per-worker namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.network

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="shaped links need root and iproute2 (ip, tc)",
)


@needs_root
def test_compare_behind_a_shaped_per_worker_link(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lowcomm.cli",
            "compare",
            "--strategies",
            "diloco",
            "--model",
            "tiny",
            "--workers",
            "2",
            "--steps",
            "12",
            "--bandwidth",
            "20mbit",
            "--topology",
            "per-worker",
            "--out",
            str(out),
            "batch_size=4",
            "seq_len=32",
            "sync_every=4",
            "eval_every=0",
            "eval_batches=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    res = json.loads((out / "results.json").read_text())
    assert res[0]["name"] == "diloco-20mbit" and res[0]["topology"] == "per-worker"
    assert abs(res[0]["measured_link_mbit"] - 20) < 2
    s = res[0]
    assert abs(s["compute_s"] + s["blocked_s"] - s["wall_s"]) <= 0.05 * s["wall_s"] + 0.05
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"lowcomm-{proc.pid}-" not in ns  # every namespace of that run was torn down


def test_bad_bandwidth_is_a_user_error(tmp_path, capsys, no_start):
    from test_cli import _refused

    _refused(capsys, ["compare", "--bandwidth", "fast", "--out", str(tmp_path / "o")],
             "--bandwidth fast")  # fmt: skip
