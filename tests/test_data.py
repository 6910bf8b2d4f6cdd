"""Tests for lowcomm.train.data: corpora, per-worker shards, deterministic resumable batches."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.train.data import Batches, Corpus, load_corpus, split_files, stdlib_files, val_batches


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    t0 = time.perf_counter()
    corpus = load_corpus()
    print(f"stdlib corpus loaded in {time.perf_counter() - t0:.2f} s: {corpus.description}")
    return corpus


def test_stdlib_loads(stdlib: Corpus) -> None:
    assert stdlib.vocab_size == 256 and stdlib.name == "stdlib"
    assert stdlib.train.ndim == 1 and stdlib.val.ndim == 1
    assert len(stdlib.train) > 1_000_000 and len(stdlib.val) > 10_000
    assert b"def " in stdlib.train[:100_000].tobytes()
    assert load_corpus("stdlib").description == stdlib.description


def test_stdlib_deterministic(stdlib: Corpus) -> None:
    again = load_corpus(None)
    assert np.array_equal(again.train, stdlib.train)
    assert np.array_equal(again.val, stdlib.val)


def test_stdlib_split_by_file(stdlib: Corpus) -> None:
    root, files = stdlib_files()
    in_tests = [
        bool({"test", "tests", "idle_test"} & set(p.relative_to(root).parts[:-1])) for p in files
    ]
    assert in_tests == sorted(in_tests)  # tests come last, so a size cap trims them first
    assert all("site-packages" not in p.parts for p in files)
    train, val = split_files(root, files)
    assert train and val
    assert not set(train) & set(val)
    # The corpus is exactly the files, newline-joined: val text never comes from a train file.
    assert len(stdlib.val) == sum(p.stat().st_size for p in val) + len(val) - 1
    assert len(stdlib.train) == sum(p.stat().st_size for p in train) + len(train) - 1
    train_bytes = stdlib.train.tobytes()
    for path in sorted(val, key=lambda p: p.stat().st_size)[-3:]:
        assert path.read_bytes()[:2000] not in train_bytes


def _starts_in_shard(b: Batches, step: int) -> None:
    starts = b.window_starts(step)
    for s in starts:  # every window lies inside one of this worker's ranges
        assert any(lo <= s and s + b.seq_len + 1 <= hi for lo, hi in b.owned_ranges())


@pytest.mark.parametrize("shard,block", [("contiguous", 65536), ("striped", 500)])
def test_shards_disjoint(shard, block) -> None:
    tokens = np.arange(10_000, dtype=np.int64) % 256
    world = 4
    samplers = [
        Batches(tokens, 8, 16, rank=r, world_size=world, seed=3, shard=shard, block_tokens=block)
        for r in range(world)
    ]
    ranges = sorted(r for b in samplers for r in b.owned_ranges())
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start  # no token belongs to two workers
    for b in samplers:
        for step in range(20):
            _starts_in_shard(b, step)
    if shard == "striped":  # each worker's data spans the whole corpus
        for b in samplers:
            assert b.owned_ranges()[0][0] < 2000 and b.owned_ranges()[-1][1] > 8000


def test_batches_content_and_determinism() -> None:
    tokens = np.arange(5_000, dtype=np.uint16)  # distinct tokens: a window reveals its offset
    a = Batches(tokens, 4, 32, rank=1, world_size=2, seed=7)
    x, y = a.next()
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[:, 0], torch.from_numpy(a.window_starts(0)))
    assert a.step == 1
    b = Batches(tokens, 4, 32, rank=1, world_size=2, seed=7)
    assert torch.equal(b.next()[0], x)
    other_rank = Batches(tokens, 4, 32, rank=0, world_size=2, seed=7)
    assert not torch.equal(other_rank.next()[0], x)
    other_seed = Batches(tokens, 4, 32, rank=1, world_size=2, seed=8)
    assert not torch.equal(other_seed.next()[0], x)
    assert not torch.equal(a.next()[0], x)  # successive steps differ


def test_resume() -> None:
    tokens = np.arange(20_000, dtype=np.int64)
    a = Batches(tokens, 2, 8, seed=1)
    for _ in range(5):
        a.next()
    state = a.state_dict()
    assert state == {"step": 5}
    expected = [a.next() for _ in range(3)]
    b = Batches(tokens, 2, 8, seed=1)
    b.load_state_dict(state)
    for want, got in zip(expected, (b.next() for _ in range(3))):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_shard_too_short() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        Batches(np.zeros(100, dtype=np.uint8), 2, 32, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        Batches(np.zeros(100, dtype=np.uint8), 2, 4, rank=4, world_size=4)


def test_val_batches() -> None:
    tokens = np.arange(3_000, dtype=np.int64)
    a = val_batches(tokens, 4, 16, n_batches=3, seed=0)
    b = val_batches(tokens, 4, 16, n_batches=3, seed=0)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (4, 16) and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    starts = torch.cat([x[:, 0] for x, _ in a])
    assert starts.max() > 2_000  # spread over the whole val set, not bunched at the front
    with pytest.raises(ValueError):
        val_batches(tokens[:10], 1, 16, 1)


def test_text_file(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    text = "héllo wörld\n" * 500
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path))
    data = text.encode("utf-8")
    assert corpus.vocab_size == 256 and corpus.name == "book.txt"
    assert corpus.train.tobytes() + corpus.val.tobytes() == data
    assert len(corpus.val) == len(data) // 20


def test_folder(tmp_path: Path) -> None:
    for i in range(60):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i}.md").write_text(f"# document {i}\n" + "words " * 50, encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp_path / ".hidden.txt").write_text("secret")
    corpus = load_corpus(str(tmp_path))
    assert corpus.vocab_size == 256 and "60 text files (1 non-UTF-8 skipped)" in corpus.description
    assert "path hash" in corpus.description
    train, val = corpus.train.tobytes(), corpus.val.tobytes()
    assert b"secret" not in train + val
    val_docs = {line for line in val.split(b"\n") if line.startswith(b"# document")}
    train_docs = {line for line in train.split(b"\n") if line.startswith(b"# document")}
    assert val_docs and train_docs and not val_docs & train_docs
    assert len(val_docs) + len(train_docs) == 60


def test_small_folder_falls_back_to_tail(tmp_path: Path) -> None:
    (tmp_path / "only.txt").write_text("abc " * 1000)
    corpus = load_corpus(str(tmp_path))
    assert len(corpus.val) > 0 and len(corpus.train) > 0


@pytest.mark.parametrize("dtype", ["uint16", "uint8"])
def test_bin(tmp_path: Path, dtype: str) -> None:
    tokens = (np.arange(4_000) * 7 % 200).astype(dtype)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    spec = str(path) if dtype == "uint16" else f"{path}:uint8"
    corpus = load_corpus(spec)
    assert corpus.vocab_size == 200
    assert isinstance(corpus.train, np.memmap)
    assert np.array_equal(np.concatenate([corpus.train, corpus.val]), tokens)
    assert len(corpus.val) == 200
    x, _ = Batches(corpus.train, 2, 16).next()
    assert x.max() < 200
    assert load_corpus(spec, vocab_size=512).vocab_size == 512


def test_bin_sibling_val(tmp_path: Path) -> None:
    np.arange(1_000, dtype=np.uint32).tofile(tmp_path / "train.bin")
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "val.bin")
    corpus = load_corpus(f"{tmp_path / 'train.bin'}:uint32")
    assert len(corpus.train) == 1_000 and len(corpus.val) == 100
    assert corpus.vocab_size == 1_000


def test_bin_bad_size(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="multiple"):
        load_corpus(str(tmp_path / "odd.bin"))


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError) as err:
        load_corpus(str(missing))
    assert str(missing) in str(err.value) and "stdlib" in str(err.value) and "hf:" in str(err.value)


def test_hf_without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import datasets` fail even where it is installed:
    # nothing downloads.
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'lowcomm\[hf\]'"):
        load_corpus("hf:roneneldan/TinyStories")


def test_binary_file_is_not_text(tmp_path: Path) -> None:
    from lowcomm.errors import ConfigError

    garbage = tmp_path / "corpus.txt"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_corpus(str(garbage))
    # token ids saved under another extension: the message says to give it a .bin name
    tokens = tmp_path / "tokens.u16"
    tokens.write_bytes((np.arange(20_000) % 50_000).astype(np.uint16).tobytes())
    with pytest.raises(ConfigError, match=r"tokens\.bin"):
        load_corpus(str(tokens))
    # a few stray bytes in real text are tolerated
    text = tmp_path / "mostly.txt"
    text.write_bytes(b"plain text line\n" * 1000 + b"\xff\xfe")
    assert len(load_corpus(str(text)).train) > 0


def test_unknown_token_dtype(tmp_path: Path) -> None:
    from lowcomm.errors import ConfigError

    (tmp_path / "tokens.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    with pytest.raises(ConfigError, match="unknown token dtype 'int7'.*uint16"):
        load_corpus(f"{tmp_path / 'tokens.bin'}:int7")


def test_repeat_warning() -> None:
    from lowcomm.train.data import repeat_warning

    corpus = Corpus(
        train=np.zeros(1000, dtype=np.uint8),
        val=np.zeros(100, dtype=np.uint8),
        vocab_size=256,
        name="x",
        description="x",
    )
    assert repeat_warning(corpus, 10_000) is None  # 10 passes: the limit
    warning = repeat_warning(corpus, 27_000)
    assert warning is not None and "27 times" in warning and "1,000 train tokens" in warning
