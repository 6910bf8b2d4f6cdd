"""The torchft-diloco compare entry: PyTorch's torchft DiLoCo run by our trainer as a peer."""

from __future__ import annotations

import sys

import pytest

from lowcomm.config import ConfigError, build_configs
from lowcomm.peers import torchft as torchft_peer
from lowcomm.presets import preset_config
from lowcomm.train.launch import launch


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


def test_torchft_diloco_equals_our_diloco(tmp_path) -> None:
    """Two independent implementations of the same math, same data: same losses and bytes."""
    pytest.importorskip("torchft")
    common = dict(
        model="tiny", steps=30, sync_every=10, eval_every=10, timeout_s=60, progress=False
    )
    out = {}
    for strategy in ("diloco", "torchft-diloco"):
        sync_cfg, train_cfg = build_configs(common, sync=preset_config(strategy))
        out[strategy] = launch(strategy, sync_cfg, train_cfg, tmp_path / strategy, 2)
    ours, theirs = out["diloco"], out["torchft-diloco"]
    assert theirs["syncs"] == ours["syncs"] == 3
    # ours carries one extra FP32 element per sync (the all-present flag), ring cost 1x at M = 2
    assert ours["bytes_sent_per_worker"] - theirs["bytes_sent_per_worker"] == 4 * 3
    assert theirs["final_val_loss"] == pytest.approx(ours["final_val_loss"], abs=1e-5)
    assert 0 < theirs["blocked_s"] < theirs["wall_s"]
