"""`lowcomm bench sync`: every stage of every strategy is reported, and the stages add up.

No timing thresholds: a test never asserts on how fast the machine was.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from lowcomm.cli import main
from lowcomm.lab.bench.floor import floor_passes
from lowcomm.lab.bench.sync import STAGES, tensor_bytes
from lowcomm.presets import preset_config

STRATEGIES = ["diloco", "streaming", "sparseloco", "co2"]


def test_bench_sync_reports_every_stage(capsys) -> None:
    argv = ["bench", "sync", "--model", "tiny", "--workers", "2", "--sync-every", "4"]
    argv += ["--repeats", "1", "--warmup", "1", "--inner-steps", "1", "--json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["workers"] == 2 and res["model_fp32_bytes"] == 4 * res["params"]
    assert list(res["strategies"]) == STRATEGIES
    for name, r in res["strategies"].items():
        stages = r["stages_s"]
        assert set(stages) == set(STAGES), name
        assert all(v >= 0 for v in stages.values()), (name, stages)
        assert sum(stages.values()) <= r["total_s"] * (1 + 1e-9), (name, stages, r["total_s"])
        for rnd in r["rounds"]:
            assert sum(rnd[s] for s in STAGES) <= rnd["total"] * (1 + 1e-9), (name, rnd)
        assert r["ratio"] > 0 and r["inner_step_median_s"] > 0
        # every engine keeps a global copy of the whole model at least
        assert r["buffers_model_multiple"]["global"] == 1.0, name
        assert r["extra_model_multiple"] >= 1.0
        # the floor: its passes at the copy speed measured in the run; work is the rest
        assert r["floor_s"] == pytest.approx(r["floor_passes"]["total"] * r["copy_s"] / 2)
        assert r["work_vs_floor"] == pytest.approx(r["work_s"] / r["floor_s"])
        # work is the median round's time less its collectives, recomputed from the rounds
        work = statistics.median(x["total"] - x["collective"] for x in r["rounds"])
        assert r["work_s"] == pytest.approx(work)
    held = res["strategies"]
    assert held["sparseloco"]["buffers_model_multiple"]["compensation"] == 1.0  # error feedback
    assert held["co2"]["buffers_model_multiple"]["snapshot"] == 1.0  # continue merge
    assert held["diloco"]["buffers_model_multiple"]["outer"] == 1.0  # Nesterov momentum


def test_tensor_bytes_counts_nested_tensors() -> None:
    nested = {"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.int64), None], "c": "x"}
    assert tensor_bytes(nested) == 3 * 4 + 2 * 8


def test_floor_counts_the_passes_of_each_method() -> None:
    """The passes docs/benchmarking.md §3 counts, method by method (payloads per element:
    FP32 4 bytes, FP4 with 128-element blocks 4.25 bits, top-k 1/64 about 0.22 bits)."""

    def total(strategy: str, merge: str, dense: bool, bpe: float, sparse: bool = False) -> float:
        cfg = preset_config(strategy, workers=2, sync_every=30)
        return floor_passes(cfg, merge, dense, bpe, workers=2, sparse=sparse)["total"]

    # Δ 3 + codec 2 | outer 5 | replace 2
    assert total("diloco", "replace", True, 4.0) == 12.0
    # Δ 3 + codec 1 + payload | 2 payloads read + mean | outer 5 | alpha-mix 3
    fp4 = 4.25 / 8
    assert total("streaming", "alpha", False, fp4) == pytest.approx(
        3 + 1 + fp4 / 4 + 2 * fp4 / 4 + 1 + 5 + 3
    )
    # Δ 3 + error feedback 3 + codec 1 | mean 1 | SGD 3 | replace 2 (payloads ~0)
    assert total("sparseloco", "replace", False, 0.0, sparse=True) == 13.0
    # Δ 3 + codec 2 + own 1 | outer 3 | continue 6
    assert total("co2", "continue", True, 4.0) == 15.0


def _gpu_workload(rank: int, world: int, state_device: str) -> dict:
    from lowcomm.lab.bench import gpu

    args = gpu.parser().parse_args(
        ["--device", "cpu", "--layers", "2", "--width", "32", "--heads", "2", "--seq", "16",
         "--vocab", "256", "--batch", "2", "--steps", "4", "--warmup", "1", "--sync-every", "2",
         "--strategies", "diloco,sparseloco", "--state-device", state_device]
    )  # fmt: skip
    return gpu.run(args, rank)


def test_the_gpu_workload_runs_its_loop_and_table_on_a_cpu(workers):
    """`bench sync --device cuda`'s workload on the CPU in a tiny shape (a world of one): every
    method gets a row with its speed against the plain loop before and after, and stages per
    sync that add up to no more than their total."""
    pytest.importorskip("transformers")
    from lowcomm.lab.bench.gpu import table

    (result,) = workers(_gpu_workload, 1, "model")
    rows = result["rows"]
    assert [r["strategy"] for r in rows] == ["diloco", "sparseloco"]
    assert result["triton"] is False  # no kernel ran on a CPU (its rows say the same)
    for r in rows:
        assert r["state_device"] == "model" and r["triton_launches"] == 0
        assert r["syncs"] == 2 and len(r["plain_tok_s_before_after"]) == 2
        assert r["speed"] == pytest.approx(r["tok_s"] / r["plain_tok_s"])
        stages = r["stages_s"]
        parts = sum(stages[k] for k in ("encode", "collective", "decode_sum", "outer", "merge"))
        assert 0 < parts <= stages["total"] + 1e-9
    assert "| sparseloco | 2 |" in table(result)


def test_host_syncs_are_counted_on_lowcomms_own_lines_only():
    """A sync-debug warning counts against the sync when lowcomm's engine made it, not when the
    benchmark's own loop or another package did; a row without the count shows a dash."""
    from lowcomm.lab.bench.gpu import _engines, table

    assert _engines("/x/src/lowcomm/engine/sync.py")
    assert _engines("/x/site-packages/lowcomm/codecs/topk.py")
    assert not _engines("/x/src/lowcomm/lab/bench/gpu.py")
    assert not _engines("/x/site-packages/torch/nn/functional.py")
    row = {
        "strategy": "diloco", "h": 50, "speed": 1.0, "tok_s": 1.0, "plain_tok_s": 1.0,
        "stages_s": dict.fromkeys(
            ("encode", "collective", "decode_sum", "outer", "merge", "total"), 0.001
        ), "sync_share_of_round": 0.01, "extra_peak_bytes": 0,
    }  # fmt: skip
    lines = table({"rows": [row, {**row, "host_syncs_per_sync": 1.0}]}).splitlines()
    assert lines[2].split("|")[-3].strip() == "-" and lines[3].split("|")[-3].strip() == "1"
