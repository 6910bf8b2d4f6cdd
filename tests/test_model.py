"""Tests for lowcomm.train.model: shapes, init, causality, presets, and that it learns."""

from __future__ import annotations

import math
import time

import pytest
import torch

from lowcomm.train.model import PRESETS, Decoder, ModelConfig, build_model, count_params


def _tokens(batch: int, seq: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_loss_at_init() -> None:
    torch.manual_seed(0)
    model = build_model("tiny")
    x, y = _tokens(4, 32), _tokens(4, 32, seed=1)
    logits = model(x)
    assert logits.shape == (4, 32, 256)
    loss = model(x, y)
    assert loss.shape == ()
    # Small init makes the initial prediction near-uniform over the vocabulary.
    assert abs(loss.item() - math.log(256)) < 0.3


def test_fragment_layout() -> None:
    model = build_model("tiny")
    assert isinstance(model.embed, torch.nn.Embedding)
    assert isinstance(model.head, torch.nn.Linear) and model.head.bias is None
    assert len(model.blocks) == PRESETS["tiny"].n_layers
    # Untied: embeddings, blocks, final norm and head partition the parameters.
    parts = [model.embed, *model.blocks, model.norm, model.head]
    assert sum(count_params(m) for m in parts) == count_params(model)
    assert model.embed.weight.data_ptr() != model.head.weight.data_ptr()
    # No buffers: state_dict() is exactly the parameters.
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 10_000, 100_000), ("small", 0.8e6, 1.2e6), ("base", 9e6, 11e6), ("85m", 84e6, 87e6)],
)
def test_preset_param_counts(preset: str, low: float, high: float) -> None:
    # The meta device allocates nothing, so counting the 85m preset is free.
    with torch.device("meta"):
        model = build_model(preset)
    n = count_params(model)
    print(f"{preset}: {n:,} parameters")
    assert low <= n <= high


def test_vocab_override() -> None:
    with torch.device("meta"):
        model = build_model("85m", vocab_size=50257)
    assert model.head.out_features == 50257
    assert 160e6 < count_params(model) < 165e6
    assert PRESETS["85m"].vocab_size == 256  # overrides never mutate the preset


def test_bad_presets_and_configs() -> None:
    with pytest.raises(ValueError, match="tiny.*small.*base.*85m"):
        build_model("huge")
    with pytest.raises(ValueError, match="'124m' is now '85m'.*--model 85m"):
        build_model("124m")  # the old name says where it went
    with pytest.raises(ValueError, match="n_heads"):
        build_model("tiny", n_heads=3)
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        build_model("tiny", width=4)
    model = build_model(ModelConfig(dim=16, n_layers=1, n_heads=2, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(1, 9))


def test_causal() -> None:
    torch.manual_seed(0)
    model = build_model("tiny").eval()
    x = _tokens(2, 16)
    t = 9
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_same_seed_same_weights() -> None:
    torch.manual_seed(123)
    a = build_model("tiny")
    torch.manual_seed(123)
    b = build_model("tiny")
    torch.manual_seed(124)
    c = build_model("tiny")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_init_scales() -> None:
    torch.manual_seed(0)
    model = build_model("small")
    std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    block = model.blocks[0]
    assert abs(block.attn.proj.weight.std().item() - std) < 0.2 * std
    assert abs(block.mlp.down.weight.std().item() - std) < 0.2 * std
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 0.002
    assert torch.equal(block.attn_norm.weight, torch.ones_like(block.attn_norm.weight))


def test_learns_and_step_time() -> None:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model: Decoder = build_model("tiny")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x = _tokens(4, 33)
        inputs, targets = x[:, :-1], x[:, 1:]
        losses, times = [], []
        for _ in range(12):
            t0 = time.perf_counter()
            loss = model(inputs, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    step_ms = 1000 * sorted(times[2:])[len(times[2:]) // 2]
    print(f"tiny: median training step {step_ms:.2f} ms (batch 4 x seq 32, 1 thread)")
    assert losses[-1] < losses[0] - 0.5
