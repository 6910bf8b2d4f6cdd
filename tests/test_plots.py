"""compare's plots: loss curves always, utilization vs bandwidth for a sweep."""

from __future__ import annotations

import json

from lowcomm.bench.compare import plot_results


def _fake(tmp_path, name, entry, bw, util):
    d = tmp_path / name
    d.mkdir()
    recs = [{"step": s, "tokens": s * 100, "bytes_sent": s * 10, "wall_s": s * 0.1, "val_loss": 5 - s / 100}
            for s in (10, 20, 30)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {"name": name, "entry": entry, "strategy": entry, "bandwidth": bw, "compute_utilization": util}


def test_sweep_draws_utilization_plot(tmp_path):
    results = [_fake(tmp_path, f"{e}-{bw}", e, bw, u) for e, bw, u in
               [("ddp", "10mbit", 0.1), ("ddp", "1gbit", 0.9), ("diloco", "10mbit", 0.95), ("diloco", "1gbit", 1.0)]]
    written = plot_results(results, tmp_path)
    names = {p.name for p in written}
    assert {"loss_vs_tokens.png", "loss_vs_bytes.png", "loss_vs_wallclock.png",
            "utilization_vs_bandwidth.png"} <= names
    for p in written:
        assert p.stat().st_size > 5000  # a real PNG with content


def _finished(folder, name, strategy, loss):
    d = folder / name
    d.mkdir(parents=True)
    recs = [{"step": s, "tokens": s * 100, "bytes_sent": s * 10, "wall_s": s * 0.1, "val_loss": loss + 1 - s / 30}
            for s in (10, 20, 30)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"name": name, "strategy": strategy, "final_val_loss": loss, "bytes_sent_per_worker": 100,
               "ddp_fp32_bytes_per_worker": 1000, "wall_s": 3.0, "compute_utilization": 0.9}
    (d / "summary.json").write_text(json.dumps(summary))


def test_report_merges_folders_and_averages_seeds(tmp_path):
    from lowcomm.bench.compare import write_report

    for folder, ddp, sl in (("screen", 1.0, 1.5), ("seed1", 1.2, 1.7)):
        _finished(tmp_path / folder, "ddp", "ddp", ddp)
        _finished(tmp_path / folder, "sparseloco-density=1_32", "sparseloco", sl)
    out = tmp_path / "report"
    results = write_report([tmp_path / "screen", tmp_path / "seed1"], out)
    assert sorted(r["name"] for r in results) == ["screen/ddp", "screen/sparseloco-density=1_32",
                                                  "seed1/ddp", "seed1/sparseloco-density=1_32"]
    table = (out / "results.md").read_text()
    # per-entry means over the two folders: DDP 1.1, SparseLoCo 1.6 (ratio 1.455), spread 0.2
    assert "| sparseloco-density=1_32 | 2 | 1.6000 | 0.2000 | 1.455 |" in table
    assert "| ddp | 2 | 1.1000 | 0.2000 | 1.000 |" in table
    assert (out / "loss_vs_tokens.png").stat().st_size > 5000


def test_report_cli_names_a_missing_folder(tmp_path, capsys):
    from lowcomm.cli import main

    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "nope: no such folder" in capsys.readouterr().err
