"""lowcomm.load_model: a run folder gives back the trained model, no internal imports needed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import lowcomm
from lowcomm.train.data import load_corpus, val_batches


def test_load_model_reproduces_the_final_validation_loss(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(
        "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowcomm.cli",
            "train",
            "--strategy",
            "diloco",
            "--workers",
            "2",
            "--steps",
            "6",
            "--model",
            "tiny",
            "--out",
            str(out),
            f"data={text}",
            "sync_every=3",
            "batch_size=2",
            "seq_len=16",
            "eval_batches=2",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())

    model = lowcomm.load_model(out)
    assert not model.training
    # the trainer's validation loss, recomputed here: same corpus, same fixed batches
    corpus = load_corpus(str(text))
    batches = val_batches(corpus.val, 2, 16, 2, seed=0)
    with torch.no_grad():
        losses = [model(x, y).item() for x, y in batches]
    assert sum(losses) / len(losses) == pytest.approx(summary["final_val_loss"], rel=1e-5)
    # the model.pt path works too, and gives the same weights
    again = lowcomm.load_model(out / "model.pt")
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_load_model_names_a_missing_run(tmp_path):
    with pytest.raises(lowcomm.ConfigError, match="not found"):
        lowcomm.load_model(tmp_path / "nope")
