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
