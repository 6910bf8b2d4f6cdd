"""RunSummary: summary.json read and written without losing a key; what makes runs comparable."""

from __future__ import annotations

import json

from lowcomm.train.summary import RunSummary

WRITTEN = {
    "name": "diloco",
    "strategy": "diloco",
    "workers": 2,
    "params": 1000,
    "tokens": 640,
    "inner_steps": 10,
    "final_val_loss": 3.5,
    "bytes_sent_per_worker": 12,
    "wall_s": 2.0,
    "compute_s": 1.5,
    "compute_utilization": 0.75,
    "seed": 0,
    "config": {"model": "tiny", "data": "x.txt", "steps": 10, "seed": 0, "sync_every": 5},
    "data": "text file x.txt",
    "some_future_field": [1, 2],
}


def test_round_trip_keeps_every_key(tmp_path):
    s = RunSummary.from_dict(WRITTEN)
    assert s.final_val_loss == 3.5 and s.config["sync_every"] == 5 and s.n_layers is None
    assert s.extra == {"some_future_field": [1, 2]}
    s.write(tmp_path / "summary.json")
    written = json.loads((tmp_path / "summary.json").read_text())
    # a config of a few keys (an older or hand-written summary) gets no derived command
    assert s.command() is None and written == WRITTEN
    assert RunSummary.read(tmp_path) == s


def test_seeds_share_a_config_key_other_data_does_not():
    a = RunSummary.from_dict(WRITTEN)
    b = RunSummary.from_dict(
        {**WRITTEN, "seed": 1, "config": {**WRITTEN["config"], "seed": 1, "progress": False}}
    )
    other_h = RunSummary.from_dict({**WRITTEN, "config": {**WRITTEN["config"], "sync_every": 50}})
    other_data = RunSummary.from_dict({**WRITTEN, "data": "text file y.txt"})
    assert a.config_key() == b.config_key()
    assert a.config_key() != other_h.config_key() and a.problem_key() == other_h.problem_key()
    assert a.problem_key() != other_data.problem_key()
