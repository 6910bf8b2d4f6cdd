"""The compute-utilization simulator (lowcomm.lab.sim): paper tables, physics, CLI, --from-run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lowcomm.lab.sim import (
    GRID,
    PAPER_WIRE_SCALE,
    PRESETS,
    TARGETS,
    Link,
    Strategy,
    Workload,
    bandwidth_grid,
    cli,
    layer_groups,
    load_run,
    make_strategies,
    min_bandwidth,
    min_bandwidth_table,
    simulate,
)

# The Streaming DiLoCo paper's Table 4 (Douillard et al., 2025): first Gbit/s of the grid that
# reaches 50/80/90/95/99% compute utilization. The 1B block is docs/benchmarking.md §4's bar.
# Typed here apart from the report's copy on purpose (double entry: see the test below).
PAPER_TABLE4 = {
    "1b": {
        "dp": [86.8, 152.6, 184.2, 222.3, 569.0],
        "diloco": [1.4, 6.2, 13.3, 23.3, 86.8],
        "streaming": [1.4, 5.2, 9.1, 16.0, 28.1],
        "streaming_overlap": [1.4, 4.3, 6.2, 9.1, 11.0],
        "streaming_overlap_fp4": [0.4, 0.9, 1.7, 2.0, 3.0],
    },
    "10b": {
        "dp": [104.8, 222.3, 222.3, 268.3, 471.5],
        "diloco": [1.7, 7.5, 16.0, 33.9, 104.8],
        "streaming": [1.7, 5.2, 9.1, 13.3, 19.3],
        "streaming_overlap": [1.7, 3.6, 5.2, 6.2, 7.5],
        "streaming_overlap_fp4": [0.4, 0.9, 1.4, 1.4, 1.7],
    },
    "100b": {
        "dp": [184.2, 323.8, 390.7, 390.7, 471.5],
        "diloco": [3.0, 11.0, 23.3, 49.4, 184.2],
        "streaming": [2.4, 6.2, 9.1, 11.0, 19.3],
        "streaming_overlap": [1.7, 3.6, 4.3, 5.2, 5.2],
        "streaming_overlap_fp4": [0.5, 0.9, 1.1, 1.1, 1.4],
    },
}


def grid_pos(gbps: float | None) -> int:
    """Index of a published value on the 50-point grid: the nearest point in log space.

    The paper prints one decimal and not always the nearest one (1.151 as 1.1, 2.947 as 3.0,
    0.543 as 0.5), so a value is accepted within half a grid step of its point."""
    assert gbps is not None
    pos = int(np.argmin(np.abs(np.log(GRID) - np.log(gbps))))
    assert abs(np.log(GRID[pos] / gbps)) < 0.5 * np.log(GRID[1] / GRID[0]), (
        f"{gbps} is off the grid"
    )
    return pos


def step_offsets(model: str, wire_scale: float = 1.0) -> dict[str, list[int]]:
    """Our grid position minus the paper's, per row and target."""
    preset = PRESETS[model]
    rows = {k: v for k, v in make_strategies(preset.workload).items() if k in PAPER_TABLE4[model]}
    ours = min_bandwidth_table(preset.workload, rows, Link(preset.workers, wire_scale=wire_scale))
    return {
        k: [grid_pos(a) - grid_pos(b) for a, b in zip(ours[k], PAPER_TABLE4[model][k])]
        for k in rows
    }


# ---------------------------------------------------------------------------- fidelity to papers


def test_grid_is_the_papers():
    assert np.allclose(GRID, np.logspace(-1, 3, 50))
    assert np.allclose(bandwidth_grid(), GRID)


def test_1b_table_within_one_grid_step():
    """docs/benchmarking.md §4: every 1B cell within one step of the 50-point grid
    (physical model)."""
    offsets = step_offsets("1b")
    bad = {k: v for k, v in offsets.items() if max(abs(x) for x in v) > 1}
    assert not bad, f"cells more than one grid step away: {bad}"


def test_physical_model_vs_paper_10b_100b():
    """Independent check on the paper's 10B/100B rows: documented in benchmarks/simulator.md.

    The physical accounting sits at or one step above the paper everywhere but one cell (100B,
    streaming + overlap, 50%: two steps). Pinned so a model change that moves this is noticed.
    """
    o10, o100 = step_offsets("10b"), step_offsets("100b")
    assert all(0 <= x <= 1 for v in o10.values() for x in v), o10
    flat = [x for v in o100.values() for x in v]
    assert all(0 <= x <= 2 for x in flat), o100
    assert flat.count(2) == 1 and o100["streaming_overlap"][0] == 2


def test_paper_wire_scale_reproduces_table4():
    """One global constant (no per-cell values) puts every cell within a step, most exactly."""
    flat = [x for m in PAPER_TABLE4 for v in step_offsets(m, PAPER_WIRE_SCALE).values() for x in v]
    assert len(flat) == 75
    assert max(abs(x) for x in flat) <= 1
    assert flat.count(0) >= 65


def test_paper_table1_hours_at_1gbit():
    """Paper Table 1 (1B, 25B tokens): 0.67 h unconstrained; at 1 Gbit/s data-parallel takes 109 h
    and streaming with overlapped FP4 0.88 h. The physical model agrees within a few percent."""
    w = PRESETS["1b"].workload
    rows = make_strategies(w)
    dp = simulate(w, rows["dp"], [1.0]).utilization[0]
    fp4 = simulate(w, rows["streaming_overlap_fp4"], [1.0]).utilization[0]
    assert 0.67 / dp == pytest.approx(109, rel=0.03)
    assert 0.67 / fp4 == pytest.approx(0.88, rel=0.05)


# ---------------------------------------------------------------------------- physics of the model


def test_utilization_rises_with_bandwidth_and_is_bounded():
    for preset in PRESETS.values():
        for strat in make_strategies(preset.workload).values():
            u = simulate(preset.workload, strat, GRID, Link(preset.workers)).utilization
            assert np.all(np.diff(u) >= -1e-12), strat.name
            assert np.all((u > 0) & (u <= 1.0))
            assert simulate(preset.workload, strat, [1e9]).utilization[0] == pytest.approx(
                1.0, abs=1e-6
            )


def test_dp_closed_forms():
    """Link-bound: the step is forward + one layer's backward + all transfers. Link keeping up:
    the step is S plus the last layer's transfer."""
    w = Workload(params=1e9, layers=24, step_time_s=0.1)
    dp = make_strategies(w)["dp"]
    comm = 16e9 / 0.1e9  # 16 Gbit at 0.1 Gbit/s
    slow = simulate(w, dp, [0.1]).utilization[0]
    assert slow == pytest.approx(0.1 / (0.1 / 3 + 0.2 / 3 / 24 + comm), rel=1e-9)
    fast = simulate(w, dp, [1000.0]).utilization[0]
    assert fast == pytest.approx(0.1 / (0.1 + 16.0 / 1000 / 24), rel=1e-9)


def test_diloco_closed_form_and_co2_hides_a_round():
    w = Workload(params=1e9, layers=24, step_time_s=0.1)
    rows = make_strategies(w, sync_every=100)
    comm = 16.0 / 0.5  # whole model at 0.5 Gbit/s
    u = simulate(w, rows["diloco"], [0.5]).utilization[0]
    assert u == pytest.approx(10.0 / (99 * 0.1 + 0.1 / 3 + 0.2 / 3 / 24 + comm), rel=1e-9)
    # CO2: 16 Gbit at 2 Gbit/s = 8 s, less than a 10 s round: fully hidden.
    assert simulate(w, rows["co2"], [2.0]).utilization[0] == pytest.approx(1.0)
    assert simulate(w, rows["co2"], [1.0]).utilization[0] < 0.7


def test_each_paper_improvement_helps_at_every_bandwidth():
    for preset in PRESETS.values():
        w, link = preset.workload, Link(preset.workers)
        u = {k: simulate(w, s, GRID, link).utilization for k, s in make_strategies(w).items()}
        assert np.all(u["streaming"] >= u["diloco"] - 1e-9)
        assert np.all(u["streaming_overlap"] >= u["streaming"] - 1e-9)
        assert np.all(u["streaming_overlap_fp4"] >= u["streaming_overlap"] - 1e-9)
        assert np.all(u["loco"] >= u["dp"] - 1e-9)


def test_wire_accounting_and_latency():
    ar = Strategy("x", collective="allreduce", bits_per_param=16)
    ag = Strategy("y", collective="allgather", bits_per_param=14 / 64)
    assert ar.wire_bits_per_param(2) == 16 and ar.wire_bits_per_param(4) == 24
    assert ag.wire_bits_per_param(4) == pytest.approx(3 * 14 / 64)
    assert ar.hops(4) == 6 and ag.hops(4) == 3
    w = PRESETS["1b"].workload
    dp = make_strategies(w)["dp"]
    base = simulate(w, dp, [100.0]).utilization[0]
    assert simulate(w, dp, [100.0], Link(2, latency_s=0.005)).utilization[0] < base
    assert simulate(w, dp, [100.0], Link(4)).utilization[0] < base
    r = simulate(w, dp, [100.0])
    assert r.wire_bytes_per_step == pytest.approx(1e9 * 16 / 8)


def test_sparseloco_bits_from_density_and_index_width():
    w = PRESETS["1b"].workload
    s = make_strategies(w, density=1 / 64, index_bits=12, value_bits=2)["sparseloco"]
    assert s.bits_per_param == pytest.approx(14 / 64) and s.collective == "allgather"


def test_layer_groups_match_lowcomm_schedule():
    assert layer_groups(7, 3, "strided") == [[0, 3, 6], [1, 4], [2, 5]]
    assert layer_groups(7, 3, "sequential") == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError):
        layer_groups(2, 3)


def test_sequential_pattern_is_modelled():
    w = PRESETS["100b"].workload
    seq = make_strategies(w, pattern="sequential")["streaming"]
    strided = make_strategies(w)["streaming"]
    assert not np.allclose(simulate(w, seq).utilization, simulate(w, strided).utilization)


def test_workload_from_flops_and_validation():
    w = Workload.from_flops(
        params=1e9, layers=24, flops_per_step=6e9 * 1e6, chips=8, peak_flops=1e15, mfu=0.5
    )
    assert w.step_time_s == pytest.approx(6e15 / 4e15)
    for bad in (
        dict(params=-1, layers=2, step_time_s=1),
        dict(params=1, layers=0, step_time_s=1),
        dict(params=1, layers=2, step_time_s=0),
    ):
        with pytest.raises(ValueError):
            Workload(**bad)
    with pytest.raises(ValueError):
        Link(workers=1)
    with pytest.raises(ValueError):
        Strategy("x", sync_every=0)
    with pytest.raises(ValueError):
        simulate(w, make_strategies(w)["dp"], [-1.0])


def test_min_bandwidth_none_when_never_reached():
    assert min_bandwidth(
        np.array([0.1, 0.6, 0.85]), np.array([1.0, 2.0, 3.0]), [0.5, 0.8, 0.9]
    ) == [2.0, 3.0, None]


# ---------------------------------------------------------------------------- CLI


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("model", ["1b", "10b", "100b"])
def test_cli_json_contract(model, capsys):
    rc, out, err = run_cli(["--model", model, "--json"], capsys)
    assert rc == 0 and not err
    data = json.loads(out)
    assert list(data) == ["model", "targets", "rows"]
    assert data["model"] == model and data["targets"] == list(TARGETS)
    assert list(data["rows"]) == [
        "dp",
        "diloco",
        "streaming",
        "streaming_overlap",
        "streaming_overlap_fp4",
        "sparseloco",
        "co2",
        "loco",
    ]
    for vals in data["rows"].values():
        assert len(vals) == 5 and all(v is None or v > 0 for v in vals)


def test_cli_json_matches_library(capsys):
    rc, out, _ = run_cli(["--model", "1b", "--json"], capsys)
    rows = json.loads(out)["rows"]
    p = PRESETS["1b"]
    lib = min_bandwidth_table(p.workload, make_strategies(p.workload), Link(p.workers))
    for k in lib:
        assert rows[k] == pytest.approx(lib[k], rel=1e-3)


def test_cli_table_custom_model_and_flops(capsys):
    rc, out, _ = run_cli(["--model", "100b"], capsys)
    assert rc == 0 and "data-parallel" in out and "100b" in out
    rc, out, _ = run_cli(
        [
            "--layers",
            "80",
            "--params",
            "70b",
            "--step-time",
            "3",
            "--workers",
            "4",
            "--sync-every",
            "50",
            "--latency",
            "20",
            "--bandwidths",
            "1,10",
        ],
        capsys,
    )
    assert rc == 0 and "7e+10 parameters" in out and "utilization at the given" in out
    rc, out, _ = run_cli(
        [
            "--layers",
            "24",
            "--params",
            "1e9",
            "--tokens-per-step",
            "1e6",
            "--chips",
            "8",
            "--peak-flops",
            "1e15",
            "--mfu",
            "0.5",
            "--json",
        ],
        capsys,
    )
    assert rc == 0 and json.loads(out)["model"] == "custom"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "5b"], "unknown model preset"),
        (["--params", "-1", "--layers", "4", "--step-time", "1"], "--params"),
        (["--model", "1b", "--workers", "-2"], "--workers"),
        (["--model", "1b", "--step-time", "-0.1"], "--step-time"),
        (["--model", "1b", "--latency", "-5"], "--latency"),
        (["--layers", "4"], "give --model"),
        (["--params", "1e9", "--layers", "4", "--flops-per-step", "1e15"], "--chips"),
        (["--model", "1b", "--strategies", "dp,nope"], "unknown strategies"),
        (["--model", "1b", "--targets", "0.5,2"], "--targets"),
        (["--from-run", "/nonexistent/run/dir"], "does not exist"),
    ],
)
def test_cli_bad_input_one_line_error(argv, needle, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and not out
    assert err.count("\n") == 1 and needle in err and err.startswith("lowcomm simulate: error:")


# ---------------------------------------------------------------------------- --from-run


def write_run(tmp_path: Path, **over) -> Path:
    summary = {
        "strategy": "ddp",
        "workers": 2,
        "params": 1_000_000,
        "inner_steps": 100,
        "wall_s": 20.0,
        "compute_s": 5.0,
        "blocked_s": 15.0,
        "n_layers": 4,
        "step_compute_s": 0.05,
        "bytes_sent_per_worker": 4 * 1_000_000 * 100,
        "payload_bytes_per_worker": 4 * 1_000_000 * 100,
        "compute_utilization": 0.25,
        "config": {"sync_every": 1, "bandwidth": "100mbit"},
    }
    summary.update(over)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_from_run_reads_bytes_and_predicts(tmp_path, capsys):
    run_dir = write_run(tmp_path)
    sc = load_run(run_dir)
    assert sc.wire_bits_per_param == pytest.approx(32.0)  # FP32 ring all-reduce at M = 2
    assert sc.bandwidth_gbps == pytest.approx(0.1) and sc.measured_utilization == 0.25
    rc, out, _ = run_cli(["--from-run", str(run_dir), "--json", "--bandwidths", "1"], capsys)
    data = json.loads(out)
    assert rc == 0 and list(data["rows"]) == ["ddp"]
    expect = simulate(sc.workload, sc.strategy, [0.1, 1.0], sc.link).utilization
    assert data["run"]["predicted_utilization"] == pytest.approx(expect[0], abs=1e-4)
    assert data["predicted_at"]["ddp"] == pytest.approx(list(expect), abs=1e-4)
    rc, out, _ = run_cli(["--from-run", str(run_dir)], capsys)
    assert rc == 0 and "measured compute utilization 0.250" in out


def test_from_run_streaming_config_and_shared_link(tmp_path):
    run_dir = write_run(
        tmp_path,
        strategy="streaming",
        inner_steps=300,
        bytes_sent_per_worker=3 * 1_000_000 // 2,
        topology="shared",
        config={
            "sync_every": 100,
            "blocks_per_fragment": 2,
            "overlap": 1,
            "fragment_pattern": "strided",
            "bandwidth": "1gbit",
        },
    )
    sc = load_run(run_dir)
    assert sc.strategy.fragments == 2 and sc.strategy.overlap == 1 and sc.strategy.sync_every == 100
    assert sc.per_worker_gbps == pytest.approx(0.5)
    assert sc.wire_bits_per_param == pytest.approx(4.0)  # FP4-sized: 3 syncs of each parameter


def test_from_run_missing_fields(tmp_path, capsys):
    run_dir = write_run(tmp_path)
    data = json.loads((run_dir / "summary.json").read_text())
    del data["n_layers"], data["step_compute_s"], data["compute_s"]
    (run_dir / "summary.json").write_text(json.dumps(data))
    rc, _, err = run_cli(["--from-run", str(run_dir)], capsys)
    assert rc == 2 and "n_layers" in err and "step_compute_s" in err
    rc, _, _ = run_cli(["--from-run", str(run_dir), "--layers", "4", "--step-time", "0.05"], capsys)
    assert rc == 0


# ---------------------------------------------------------------------------- no torch


def test_simulator_does_not_need_torch():
    """Import lowcomm.lab.sim with torch made unimportable (bypassing lowcomm/__init__)."""
    src = Path(__file__).resolve().parents[1] / "src" / "lowcomm"
    code = (
        "import sys, types\n"
        "sys.modules['torch'] = None\n"
        f"pkg = types.ModuleType('lowcomm'); pkg.__path__ = [{str(src)!r}]\n"
        "sys.modules['lowcomm'] = pkg\n"
        "from lowcomm.lab.sim import cli\n"
        "sys.exit(cli.main(['--model', '1b', '--json']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"] == "1b"


# ---------------------------------------------------------------------------- report


def test_report_fills_every_placeholder_of_its_template():
    """benchmarks/simulator.md's generator: the packaged template, all placeholders filled."""
    import re

    from lowcomm.lab.sim import report

    template = report._template()
    names = set(re.findall(r"\{(\w+)\}", template))
    assert {"planner_rows", "latency_table", "table4_1b", "offsets", "full_100b"} <= names
    text = report.render()
    assert not re.findall(r"\{\w+\}", text)
    assert text.startswith("# Simulator: the bandwidth a run needs")
    assert "| data-parallel | 86.8 / " in text and text.endswith("| *pending* | | | | | | | |\n")


def test_the_reports_paper_table_matches_the_tests_own_transcription():
    """The report prints the paper's table beside ours: two transcriptions made apart agree."""
    from lowcomm.lab.sim import report

    assert report.PAPER_TABLE4 == PAPER_TABLE4
