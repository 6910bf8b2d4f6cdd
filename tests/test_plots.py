"""compare's plots: loss curves always, utilization vs bandwidth for a sweep."""

from __future__ import annotations

import json

from lowcomm.lab.bench.compare import plot_results
from lowcomm.train.summary import RunSummary


def _fake(tmp_path, name, entry, bw, util):
    d = tmp_path / name
    d.mkdir()
    recs = [
        {
            "step": s,
            "tokens": s * 100,
            "bytes_sent": s * 10,
            "wall_s": s * 0.1,
            "val_loss": 5 - s / 100,
        }
        for s in (10, 20, 30)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return RunSummary(
        name=name, entry=entry, strategy=entry, bandwidth=bw, compute_utilization=util
    )


def test_sweep_draws_utilization_plot(tmp_path):
    results = [
        _fake(tmp_path, f"{e}-{bw}", e, bw, u)
        for e, bw, u in [
            ("ddp", "10mbit", 0.1),
            ("ddp", "1gbit", 0.9),
            ("diloco", "10mbit", 0.95),
            ("diloco", "1gbit", 1.0),
        ]
    ]
    written = plot_results(results, tmp_path)
    names = {p.name for p in written}
    assert {
        "loss_vs_tokens.png",
        "loss_vs_bytes.png",
        "loss_vs_wallclock.png",
        "utilization_vs_bandwidth.png",
    } <= names
    for p in written:
        assert p.stat().st_size > 5000  # a real PNG with content


def _finished(folder, name, strategy, loss):
    d = folder / name
    d.mkdir(parents=True)
    recs = [
        {
            "step": s,
            "tokens": s * 100,
            "bytes_sent": s * 10,
            "wall_s": s * 0.1,
            "val_loss": loss + 1 - s / 30,
        }
        for s in (10, 20, 30)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {
        "name": name,
        "strategy": strategy,
        "final_val_loss": loss,
        "bytes_sent_per_worker": 100,
        "ddp_fp32_bytes_per_worker": 1000,
        "wall_s": 3.0,
        "compute_utilization": 0.9,
    }
    (d / "summary.json").write_text(json.dumps(summary))


def test_report_merges_folders_and_averages_seeds(tmp_path):
    from lowcomm.lab.bench.compare import write_report

    for folder, ddp, sl in (("screen", 1.0, 1.5), ("seed1", 1.2, 1.7)):
        _finished(tmp_path / folder, "ddp", "ddp", ddp)
        _finished(tmp_path / folder, "sparseloco-density=1_32", "sparseloco", sl)
    out = tmp_path / "report"
    results = write_report([tmp_path / "screen", tmp_path / "seed1"], out)
    assert sorted(r.name for r in results) == [
        "screen/ddp",
        "screen/sparseloco-density=1_32",
        "seed1/ddp",
        "seed1/sparseloco-density=1_32",
    ]
    table = (out / "results.md").read_text()
    # per-entry means over the two folders: DDP 1.1, SparseLoCo 1.6 (ratio 1.455), spread 0.2
    assert "| sparseloco-density=1_32 | 2 | 1.6000 | 0.2000 | 1.455 |" in table
    assert "| ddp | 2 | 1.1000 | 0.2000 | 1.000 |" in table
    assert (out / "loss_vs_tokens.png").stat().st_size > 5000


def test_report_cli_names_a_missing_folder(tmp_path, capsys):
    from lowcomm.cli import main

    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "nope: no such folder" in capsys.readouterr().err


def _curve(folder, name, entry, bw, steps, walls, losses, **extra):
    d = folder / name
    d.mkdir(parents=True)
    recs = [{"step": s, "wall_s": w, "val_loss": v} for s, w, v in zip(steps, walls, losses)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {
        "name": name,
        "entry": entry,
        "strategy": entry,
        "final_val_loss": losses[-1],
        "bytes_sent_per_worker": 100,
        "ddp_fp32_bytes_per_worker": 1000,
        "wall_s": walls[-1],
        "compute_utilization": 0.5,
        "tokens": steps[-1] * 1000,
        "inner_steps": steps[-1],
        **extra,
    }
    if bw:
        summary["bandwidth"] = bw
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_time_to_loss_interpolates_between_evaluations(tmp_path):
    from lowcomm.lab.bench.compare import time_to_loss

    d = _curve(tmp_path, "a", "a", None, [10, 20, 30], [1.0, 3.0, 5.0], [4.0, 3.0, 2.0])
    assert time_to_loss(d, 2.5) == (4.0, 25.0)  # halfway between steps 20 and 30
    assert time_to_loss(d, 4.0) == (1.0, 10.0)  # reached at the first evaluation
    assert time_to_loss(d, 1.0) is None


def test_network_table_relates_each_link_to_the_unshaped_run(tmp_path):
    from lowcomm.lab.bench.compare import network_table, write_report

    _curve(tmp_path / "net", "ddp", "ddp", None, [10, 20], [1.0, 2.0], [3.0, 2.0])
    # a 10-step window on a slow link: 4 s per step, never reaches 2.0 itself
    _curve(tmp_path / "net", "ddp-10mbit", "ddp", "10mbit", [5, 10], [20.0, 40.0], [3.5, 3.2])
    _curve(tmp_path / "net", "diloco-10mbit", "diloco", "10mbit", [10, 20], [1.5, 3.0], [2.8, 1.9])
    results = write_report([tmp_path / "net"], tmp_path / "r", target_loss=2.0)
    table = network_table(results, 2.0)
    rows = {
        tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
        for line in table.splitlines()[2:]
    }
    # unshaped DDP: 20,000 tokens in 2 s; on 10mbit 10,000 tokens in 40 s
    # -> 0.025 of the unshaped rate
    assert "| 10,000 | 1.000 | 20 | 2 |" in rows[("ddp", "unshaped")]
    assert "| 250 | 0.025 | 10 | ≈ 80 (est.) |" in rows[("ddp", "10mbit")]  # 20 steps x 4 s
    # DiLoCo crosses 2.0 between 1.5 s (2.8) and 3.0 s (1.9): 1.5 + 0.8/0.9 x 1.5
    assert "| 3 |" in rows[("diloco", "10mbit")] and "| - |" in rows[("diloco", "10mbit")]
    assert "time to val loss 2.0" in (tmp_path / "r" / "results.md").read_text()


def test_compare_goes_on_after_a_lost_run_and_fails_at_the_end(tmp_path, monkeypatch):
    """A worker crash in one entry of a sweep keeps the other entries' results, then exits
    non-zero."""
    import pytest

    from lowcomm.lab.bench import compare
    from lowcomm.train.launch import LaunchError

    ran = []

    def fake_launch(spec, workers, port):
        ran.append(spec.name)
        if spec.name == "diloco":
            raise LaunchError("worker 1 failed with exit code -6")
        _finished(spec.out.parent, spec.name, spec.strategy.name, 2.0)
        return json.loads((spec.out / "summary.json").read_text())

    monkeypatch.setattr(compare, "launch", fake_launch)
    entries = compare.parse_entries("ddp,diloco,sparseloco")
    with pytest.raises(LaunchError, match=r"1 of 3 runs failed \(diloco\)"):
        compare.run_compare(entries, {"model": "tiny", "steps": 30}, 2, [0], tmp_path)
    assert ran == ["ddp", "diloco", "sparseloco"]
    table = (tmp_path / "results.md").read_text()
    assert "| ddp |" in table and "| sparseloco |" in table and "| diloco |" not in table

    def user_error(spec, *args, **kwargs):
        ran.append(spec.name)
        raise LaunchError("worker 0 stopped on a user error", 2)

    ran.clear()
    monkeypatch.setattr(compare, "launch", user_error)
    with pytest.raises(LaunchError, match="user error"):
        compare.run_compare(entries, {"model": "tiny", "steps": 30}, 2, [0], tmp_path / "again")
    assert ran == ["ddp"]  # a user error would hit every run: stop at once

    def interrupted(spec, *args, **kwargs):
        ran.append(spec.name)
        raise Interrupted("interrupted at step 3")

    from lowcomm.train.launch import Interrupted

    ran.clear()
    monkeypatch.setattr(compare, "launch", interrupted)
    with pytest.raises(Interrupted):
        compare.run_compare(entries, {"model": "tiny", "steps": 30}, 2, [0], tmp_path / "ctrl-c")
    assert ran == ["ddp"]  # Ctrl-C or SIGTERM stops the whole sweep, not one run of it


def test_plot_titles_carry_the_provenance(tmp_path, monkeypatch):
    import matplotlib.axes

    from lowcomm.lab.bench.compare import provenance

    titles = []
    original = matplotlib.axes.Axes.set_title

    def set_title(self, text, *args, **kwargs):
        titles.append(text)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", set_title)
    line = provenance("lowcomm compare --steps 30")
    plot_results([_fake(tmp_path, "ddp", "ddp", None, 0.5)], tmp_path, subtitle=line)
    assert len(titles) == 3
    assert all("lowcomm compare --steps 30" in t and "commit " in t for t in titles)
