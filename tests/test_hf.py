"""Hugging Face models through our trainer and through HF's Trainer; the local BPE tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the Hugging Face extra is not installed: "
                                           "pip install 'lowcomm[hf]'")
pytest.importorskip("tokenizers", reason="the Hugging Face extra is not installed")
from transformers import AutoModelForCausalLM  # noqa: E402

from conftest import run_workers  # noqa: E402
from helpers import tokens  # noqa: E402
from lowcomm.errors import ConfigError  # noqa: E402
from lowcomm.train.data import load_corpus, val_batches  # noqa: E402
from lowcomm.train.model import PRESETS, build_model, count_params  # noqa: E402

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
WORDS = ("alpha beta gamma delta sync worker outer inner model train step token shard "
         "fragment average momentum").split()


def _text_file(path: Path, lines: int = 2500) -> Path:
    """A small deterministic text corpus of word sequences."""
    import random

    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)))
    return path


def _val_loss(model: torch.nn.Module, batches) -> float:
    """Mean cross-entropy of an HF causal LM over (x, y) batches, y already shifted."""
    model.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
                  for x, y in batches]
    return float(torch.stack(losses).mean())


# --- models ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_hf_llama_matches_builtin_preset_size(preset):
    # Same width, depth, heads and SwiGLU width, untied head: exactly our decoder's parameter count.
    hf = build_model(f"hf:llama:{preset}", vocab_size=256)
    assert count_params(hf) == count_params(build_model(preset))
    cfg = hf.hf_model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        PRESETS[preset].dim, PRESETS[preset].n_layers, PRESETS[preset].n_heads)


def test_adapter_loss_is_hf_loss_on_shifted_targets():
    torch.manual_seed(0)
    model = build_model("hf:gpt2:tiny", vocab_size=300, max_seq_len=16)
    hf = model.hf_model
    assert hf.config.n_positions == 16 and hf.config.vocab_size == 300
    assert list(model.state_dict()) == list(hf.state_dict())  # model.pt is an HF state dict
    windows = torch.randint(0, 300, (2, 16))
    x, y = windows[:, :-1], windows[:, 1:]
    # HF shifts labels itself; by causality the logits of x are the first 15 of the window's.
    assert torch.allclose(model(x, y), hf(input_ids=windows, labels=windows).loss, atol=1e-5)


@pytest.mark.parametrize("spec,match", [("hf:nosucharch", "unknown Hugging Face model type"),
                                        ("hf:llama:huge", "unknown size preset"),
                                        ("hf:./no/such/folder", "does not exist")])
def test_bad_hf_names_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        build_model(spec, vocab_size=256)


def test_config_only_folder_builds_fresh_weights(tmp_path):
    build_model("hf:qwen2:tiny", vocab_size=256).hf_model.config.save_pretrained(tmp_path)
    model = build_model(f"hf:{tmp_path}", vocab_size=256)
    assert type(model.hf_model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ConfigError, match="needs 512 token ids"):
        build_model(f"hf:{tmp_path}", vocab_size=512)


# --- our trainer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,strategy,syncs", [
    ("llama", "diloco", 3),       # 12 steps, H = 4: one fragment synced 3 times
    ("gpt2", "streaming", 6),     # two fragments (embeddings+head, the blocks), 3 syncs each
    pytest.param("llama", "streaming", 6, marks=pytest.mark.slow),
    pytest.param("gpt2", "diloco", 3, marks=pytest.mark.slow),
])
def test_lowcomm_train_hf_model_reloads_with_from_pretrained(tmp_path, monkeypatch, arch, strategy,
                                                             syncs):
    data, out = _text_file(tmp_path / "corpus.txt"), tmp_path / "run"
    cmd = LOWCOMM + ["train", "--strategy", strategy, "--model", f"hf:{arch}:tiny", "--workers", "2",
                     "--steps", "12", "--out", str(out), f"data={data}", "tokenizer=bpe:300",
                     "batch_size=4", "seq_len=16", "sync_every=4", "eval_every=0",
                     "eval_batches=4", "progress=false", "warmup_steps=2"]
    monkeypatch.setenv("LOWCOMM_CACHE", str(tmp_path / "cache"))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["syncs"] == syncs  # streaming found the HF model's blocks
    corpus_info = json.loads((out / "corpus.json").read_text())
    assert corpus_info["vocab_size"] == 300 and "byte-level BPE" in corpus_info["description"]
    assert "lowcomm: corpus:" in res.stderr

    reloaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    saved = torch.load(out / "model.pt", weights_only=True)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, saved[name]), name
    corpus = load_corpus(str(data), tokenizer="bpe:300")  # from the run's cache
    batches = val_batches(corpus.val, 4, 16, 4, seed=0)
    assert _val_loss(reloaded, batches) == pytest.approx(summary["final_val_loss"], abs=1e-5)
