"""Checkpoint file layer: atomic per-rank files, meta.json completeness, corruption fallback,
prune, RNG."""

from __future__ import annotations

import json
import os
import random
import re
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.durable import check_weights_only_safe, sha256_file
from lowcomm.train.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    checkpoint_dir,
    config_hash,
    finalize,
    latest_complete,
    list_checkpoints,
    load_rank_state,
    prune,
    rng_state,
    save_rank_state,
    set_rng_state,
    write_meta,
)

WORLD = 2


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "step": step,
        "rank": rank,
        "model": OrderedDict(
            w=torch.randn(8, 4, generator=g), b=torch.zeros(4, dtype=torch.bfloat16)
        ),
        "engine": {
            "outer": {"frag0": {"momentum": torch.randn(32, generator=g, dtype=torch.float64)}},
            "ef": [
                torch.randint(-5, 5, (6,), generator=g, dtype=torch.int8),
                torch.ones(3, dtype=torch.bool),
            ],
            "counts": torch.arange(5, dtype=torch.int64),
            "half": torch.randn(4, generator=g).half(),
            "lr": 0.7,
            "name": "diloco",
            "flags": (True, None, 3),
            "shape": torch.Size([2, 3]),
            "dtype": torch.float16,
        },
        "history": [{"loss": 1.5, "tag": "a"}, {"loss": 1.25, "tag": "b"}],
        3: "int key",
    }


def _assert_equal(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b


def _save(run: Path, step: int, world: int = WORLD, finalize_it: bool = True) -> Path:
    d = checkpoint_dir(run, step)
    shas = [save_rank_state(d, r, _state(r, step)) for r in range(world)]
    if finalize_it:
        finalize(d, step=step, world_size=world, checksums=shas, config={"lr": 0.7})
    return d


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_layout_and_roundtrip(tmp_path: Path) -> None:
    d = _save(tmp_path, 100)
    assert d == tmp_path / "checkpoints" / "step-000000100"
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "rank0.pt", "rank1.pt"]
    meta = json.loads((d / "meta.json").read_text())
    assert meta["step"] == 100 and meta["world_size"] == WORLD
    assert meta["config_hash"] == config_hash({"lr": 0.7})
    assert (
        set(meta["files"]) == {"rank0.pt", "rank1.pt"}
        and "lowcomm_version" in meta
        and "created" in meta
    )
    for r in range(WORLD):
        _assert_equal(load_rank_state(d, r), _state(r, 100))
        # The file really is weights_only-loadable on its own.
        torch.load(d / f"rank{r}.pt", weights_only=True)
    assert latest_complete(tmp_path, world_size=WORLD) == d


def test_config_hash_stable() -> None:
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


@pytest.mark.parametrize(
    "bad, where",
    [
        (
            torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
            "state['engine']['outer']['x']",
        ),
        (lambda x: x, "state['engine']['outer']['x']"),
        (np.float64(1.0), "state['engine']['outer']['x']"),
    ],
)
def test_rejects_unloadable(tmp_path: Path, bad, where: str) -> None:
    state = {"engine": {"outer": {"ok": torch.ones(2), "x": bad}}}
    d = checkpoint_dir(tmp_path, 1)
    with pytest.raises(TypeError, match=re.escape(where)):
        save_rank_state(d, 0, state)
    assert not (d / "rank0.pt").exists()


def test_rejects_bad_keys_lists_and_cycles() -> None:
    with pytest.raises(TypeError, match=r"state\['a'\]\[1\]"):
        check_weights_only_safe({"a": [1, object()]})
    with pytest.raises(TypeError, match="key of type"):
        check_weights_only_safe({"a": {(1, 2): 3}})
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(TypeError, match="itself"):
        check_weights_only_safe({"c": cyc})
    shared = torch.ones(2)
    check_weights_only_safe({"x": shared, "y": [shared, shared]})  # shared leaves are fine


@pytest.mark.parametrize("damage", [_truncate, _flip_bit])
def test_corrupt_file_falls_back(tmp_path: Path, damage) -> None:
    good = _save(tmp_path, 10)
    bad = _save(tmp_path, 20)
    damage(bad / "rank1.pt")
    with pytest.raises(CheckpointError) as exc:
        load_rank_state(bad, 1)
    msg = str(exc.value)
    assert "rank1.pt" in msg and "checksum" in msg and str(good) in msg
    load_rank_state(bad, 0)  # the undamaged rank still loads
    with pytest.warns(CheckpointWarning, match="step-000000020.*rank1.pt"):
        assert latest_complete(tmp_path) == good
    assert (bad / "rank1.pt").exists()  # skipped, never deleted


def test_missing_file_and_no_earlier(tmp_path: Path) -> None:
    d = _save(tmp_path, 5)
    (d / "rank0.pt").unlink()
    with pytest.raises(
        CheckpointError, match="rank0.pt is missing.*No earlier complete checkpoint"
    ):
        load_rank_state(d, 0)
    with pytest.warns(CheckpointWarning, match="missing"):
        assert latest_complete(tmp_path) is None


def test_missing_meta_is_incomplete(tmp_path: Path) -> None:
    good = _save(tmp_path, 10)
    partial = _save(tmp_path, 20, finalize_it=False)
    assert list_checkpoints(tmp_path) == [good, partial]
    with pytest.warns(CheckpointWarning, match="step-000000020.*meta.json"):
        assert latest_complete(tmp_path) == good
    with pytest.raises(CheckpointError, match="meta.json"):
        load_rank_state(partial, 0)
    # An explicit checksum bypasses meta.json.
    sha = sha256_file(partial / "rank0.pt")
    assert load_rank_state(partial, 0, expected_sha256=sha)["step"] == 20


def test_world_size_mismatch_skipped(tmp_path: Path) -> None:
    _save(tmp_path, 10, world=2)
    with pytest.warns(CheckpointWarning, match="2 ranks"):
        assert latest_complete(tmp_path, world_size=4) is None


def test_write_meta_validates(tmp_path: Path) -> None:
    d = checkpoint_dir(tmp_path, 7)
    sha = save_rank_state(d, 0, {"x": 1})
    with pytest.raises(ValueError, match="ranks"):
        write_meta(d, {"step": 7, "world_size": 2}, {0: sha})
    with pytest.raises(ValueError, match="does not match"):
        write_meta(d, {"step": 8}, {0: sha})
    write_meta(d, {"step": 7, "note": "hi"}, {0: sha})
    assert latest_complete(tmp_path) == d


def test_resave_drops_stale_meta(tmp_path: Path) -> None:
    d = _save(tmp_path, 10)
    save_rank_state(d, 0, {"new": 1})
    assert not (d / "meta.json").exists()


def test_prune(tmp_path: Path) -> None:
    steps = [10, 20, 30, 40]
    for s in steps:
        _save(tmp_path, s)
    old_partial = _save(tmp_path, 25, finalize_it=False)  # crashed long ago
    _flip_bit(checkpoint_dir(tmp_path, 40) / "rank0.pt")  # newest "complete" one is corrupt
    in_progress = _save(tmp_path, 50, finalize_it=False)  # being written right now
    deleted = prune(tmp_path, keep=2)
    left = [p.name for p in list_checkpoints(tmp_path)]
    # Kept: 20, 30 (newest two that verify) and everything newer than 30
    # (40 corrupt, 50 in progress).
    assert left == ["step-000000020", "step-000000030", "step-000000040", "step-000000050"]
    assert sorted(p.name for p in deleted) == ["step-000000010", "step-000000025"]
    assert not old_partial.exists() and in_progress.exists()
    assert not any(p.name.startswith(".deleting") for p in (tmp_path / "checkpoints").iterdir())
    prune(tmp_path, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-000000030",
        "step-000000040",
        "step-000000050",
    ]
    with pytest.raises(ValueError):
        prune(tmp_path, keep=0)


def test_prune_nothing_complete(tmp_path: Path) -> None:
    _save(tmp_path, 10, finalize_it=False)
    assert prune(tmp_path, keep=1) == []
    assert len(list_checkpoints(tmp_path)) == 1


def test_crash_mid_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _save(tmp_path, 10)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    d = checkpoint_dir(tmp_path, 20)

    def crash(*a, **k):
        raise OSError("simulated crash in os.replace")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        save_rank_state(d, 0, _state(0, 20))
    monkeypatch.undo()
    assert not (d / "rank0.pt").exists()
    assert list(d.iterdir()) == []  # temp file cleaned up
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before

    # A crash inside torch.save (partial bytes written) leaves nothing behind either.
    real_save = torch.save

    def half_save(obj, f, *a, **k):
        f.write(b"PK\x03\x04partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(RuntimeError, match="disk full"):
        save_rank_state(d, 0, _state(0, 20))
    monkeypatch.setattr(torch, "save", real_save)
    assert list(d.iterdir()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        assert latest_complete(tmp_path) == good


def test_rng_roundtrip(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    torch.rand(3), np.random.rand(3), random.random()
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    random.gauss(0, 1)  # and in Python's

    def draw():
        return (
            torch.rand(5).tolist(),
            np.random.rand(5).tolist(),
            np.random.randn(3).tolist(),
            [random.random() for _ in range(5)],
            random.gauss(0, 1),
        )

    snap = rng_state()
    check_weights_only_safe(snap)
    # Through a real checkpoint file, so the state survives weights_only loading too.
    d = checkpoint_dir(tmp_path, 1)
    sha = save_rank_state(d, 0, {"rng": snap})
    first = draw()
    draw()
    set_rng_state(load_rank_state(d, 0, expected_sha256=sha)["rng"])
    assert draw() == first
