"""`lowcomm bench sync`: every stage of every strategy is reported, and the stages add up.

No timing thresholds: a test never asserts on how fast the machine was.
"""

from __future__ import annotations

import json

import torch

from lowcomm.bench.sync import STAGES, tensor_bytes
from lowcomm.cli import main

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
    held = res["strategies"]
    assert held["sparseloco"]["buffers_model_multiple"]["compensation"] == 1.0  # error feedback
    assert held["co2"]["buffers_model_multiple"]["snapshot"] == 1.0  # continue merge
    assert held["diloco"]["buffers_model_multiple"]["outer"] == 1.0  # Nesterov momentum


def test_tensor_bytes_counts_nested_tensors() -> None:
    nested = {"a": torch.zeros(3), "b": [torch.zeros(2, dtype=torch.int64), None], "c": "x"}
    assert tensor_bytes(nested) == 3 * 4 + 2 * 8
