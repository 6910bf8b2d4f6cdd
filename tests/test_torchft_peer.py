"""The torchft-diloco compare entry: PyTorch's torchft DiLoCo run by our trainer as a peer."""

from __future__ import annotations

import json
import sys

import pytest

from lowcomm.config import ConfigError, build_configs
from lowcomm.lab.peers import torchft as torchft_peer
from lowcomm.presets import preset_config
from lowcomm.train.launch import launch
from lowcomm.train.model import build_model
from lowcomm.train.spec import RunSpec


def test_missing_torchft_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'lowcomm\[torchft\]'"):
        torchft_peer.check_config(preset_config("torchft-diloco"), 0, None)


def test_unsupported_settings_are_refused() -> None:
    pytest.importorskip("torchft")
    with pytest.raises(ConfigError, match="outer_optimizer"):
        torchft_peer.check_config(preset_config("torchft-diloco", outer_optimizer="sgd"), 0, None)
    with pytest.raises(ConfigError, match="codec"):
        torchft_peer.check_config(preset_config("torchft-diloco", codec="int4"), 0, None)
    with pytest.raises(ConfigError, match="checkpoint"):
        torchft_peer.check_config(preset_config("torchft-diloco"), 10, None)


# 13-16 s, by hand (-m slow) with the streaming comparison below: a benchmark peer's agreement
# with our DiLoCo, not a path of ours (torchft's settings checks above run by default)
@pytest.mark.slow
def test_torchft_diloco_equals_our_diloco(tmp_path) -> None:
    """Two independent implementations of the same math, same data: same losses and bytes."""
    pytest.importorskip("torchft")
    common = dict(
        model="tiny", steps=30, sync_every=10, eval_every=10, timeout_s=60, progress=False
    )
    out = {}
    for strategy in ("diloco", "torchft-diloco"):
        configs = build_configs(common, sync=preset_config(strategy))
        out[strategy] = launch(RunSpec.of(strategy, configs, tmp_path / strategy), 2)
    ours, theirs = out["diloco"], out["torchft-diloco"]
    assert theirs["syncs"] == ours["syncs"] == 3
    # ours carries one extra FP32 element per sync (the all-present flag), ring cost 1x at M = 2
    assert ours["bytes_sent_per_worker"] - theirs["bytes_sent_per_worker"] == 4 * 3
    assert theirs["final_val_loss"] == pytest.approx(ours["final_val_loss"], abs=1e-5)
    assert 0 < theirs["blocked_s"] < theirs["wall_s"]


def _run_both(tmp_path, strategies: tuple[str, str], **settings) -> list[dict]:
    common = dict(model="tiny", eval_every=12, timeout_s=60, progress=False, **settings)
    out = []
    for strategy in strategies:
        configs = build_configs(common, sync=preset_config(strategy))
        out.append(launch(RunSpec.of(strategy, configs, tmp_path / strategy), 2))
    return out


# 13 s, by hand (-m slow), with the DiLoCo comparison above
@pytest.mark.slow
def test_torchft_streaming_equals_our_streaming_in_fp32(tmp_path) -> None:
    """torchft's Streaming DiLoCo and ours, FP32, 3 fragments, no overlap: the same math and,
    once torchft's fragment order is matched to ours, the same schedule: the same losses."""
    pytest.importorskip("torchft")
    ours, theirs = _run_both(
        tmp_path,
        ("streaming", "torchft-streaming"),
        steps=36,
        sync_every=12,
        fragments=3,
        blocks_per_fragment=0,
        overlap=0,
        codec="fp32",
    )
    assert theirs["syncs"] == ours["syncs"] == 3 * 3  # a fragment every 4 steps
    # the global models agree at every evaluation before the end ...
    for step in (12, 24):
        assert _val_loss(tmp_path / "torchft-streaming", step) == pytest.approx(
            _val_loss(tmp_path / "streaming", step), abs=1e-5
        )
    assert _val_loss(tmp_path / "streaming", 24) < 5.0  # it trained (untrained: ln 256 = 5.5)
    # ... and at the end ours also sends the two fragments whose last 8 and 4 steps were not
    # sent yet (leaving the block loses no step; torchft drops them), plus one FP32 flag per send
    layers = [sum(p.numel() for p in b.parameters()) for b in build_model("tiny").blocks]
    extra = 4 * sum(layers) + 4 * (9 + 2)
    assert ours["bytes_sent_per_worker"] - theirs["bytes_sent_per_worker"] == extra


def _val_loss(run, step: int) -> float:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step") == step and "val_loss" in rec:
            return rec["val_loss"]
    raise AssertionError(f"no val_loss at step {step} in {run}")


@pytest.mark.slow  # 10 s, by hand (-m slow): the default suite stays under 10 minutes
def test_torchft_streaming_with_overlap_trains_and_meters(tmp_path) -> None:
    """With tau = 1 and alpha = 0.5 torchft sends each fragment one step before its slot (ours:
    one step after), so the runs differ; both train, and torchft's bytes are counted."""
    pytest.importorskip("torchft")
    settings = dict(steps=36, sync_every=12, fragments=3, blocks_per_fragment=0, overlap=1)
    ours, theirs = _run_both(tmp_path, ("streaming", "torchft-streaming"), **settings)
    assert theirs["syncs"] == 9 and 0 < theirs["blocked_s"] < theirs["wall_s"]
    assert theirs["bytes_sent_per_worker"] > 4 * ours["bytes_sent_per_worker"]  # FP32 vs FP4
    assert max(theirs["final_val_loss"], ours["final_val_loss"]) < 4.5  # both trained (from 5.5)


def test_torchft_streaming_limits_are_checked_on_the_model_before_workers_start() -> None:
    """torchft syncs one fragment every H/P steps: H must divide by P, and tau < H/P."""
    model = build_model("tiny")  # 2 blocks: 3 fragments with blocks_per_fragment=0
    cfg = dict(fragments=3, blocks_per_fragment=0)
    torchft_peer.check_fragments(model, preset_config("torchft-streaming", sync_every=12, **cfg))
    for bad in (dict(sync_every=10), dict(sync_every=12, overlap=4)):
        with pytest.raises(ConfigError, match="divisible by the 3 fragments"):
            torchft_peer.check_fragments(model, preset_config("torchft-streaming", **cfg, **bad))
