"""Corpora as flat token arrays, and the per-worker batch sampler.

A corpus is two 1-D integer arrays (train, val). Text is tokenised as raw bytes (vocab 256), so no
tokenizer is needed and every machine gets the same tokens. The default corpus is the running
interpreter's own standard library sources: real text, no download.

Specs accepted by `load_corpus`:
  None | "stdlib"       the Python standard library's *.py sources
  PATH/TO/FILE          one text file (val = its last 5%)
  PATH/TO/FOLDER        every non-hidden UTF-8 file below it (val = files chosen by path hash)
  PATH/TO/X.bin[:DTYPE] pre-tokenized token array, memory-mapped; DTYPE uint16 (default), uint8
                        or uint32; val = sibling val.bin next to a train.bin, else the last 5%
  hf:NAME[:CONFIG]      a Hugging Face dataset's `text` field (needs `pip install 'lowcomm[hf]'`)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from .tokenizer import BPETokens

__all__ = [
    "Corpus",
    "Batches",
    "load_corpus",
    "val_batches",
    "stdlib_files",
    "split_files",
    "DEFAULT_MAX_BYTES",
    "VAL_EVERY",
    "repeat_warning",
]

DEFAULT_MAX_BYTES = 32 * 2**20
"""Cap on text read from the stdlib, a folder, or a Hugging Face dataset (bytes = tokens)."""
VAL_EVERY = 20
"""About one file in VAL_EVERY goes to validation (and 1/VAL_EVERY of a single file or .bin)."""
BIN_DTYPES = ("uint8", "uint16", "uint32")
"""Token dtypes accepted for .bin arrays."""

# Directories never read from the stdlib: third-party packages and bytecode caches.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Test directories are read last, so that when the cap bites it trims tests, not library code.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})

_ACCEPTED = (
    "accepted: 'stdlib' (default), a text file, a folder of text files, "
    "a token array 'X.bin[:uint8|uint16|uint32]', or 'hf:NAME[:CONFIG]'"
)


@dataclass
class Corpus:
    """Train and validation tokens of one corpus."""

    train: np.ndarray = field(repr=False)
    """1-D integer token array (numpy array or read-only memmap) the workers train on."""
    val: np.ndarray = field(repr=False)
    """1-D integer token array for evaluation; shares no file with `train`."""
    vocab_size: int
    """Number of distinct token ids the model needs (256 for byte-level text)."""
    name: str
    """Short name of the source, e.g. 'stdlib' or a file name."""
    description: str
    """One human-readable line: where the tokens came from and how they were split."""
    tokenizer_file: str | None = None
    """The `tokenizers` JSON file that produced the tokens (None for bytes and .bin arrays)."""

    def save_description(self, out_dir: str | Path) -> None:
        """Print the description and write it with token counts and vocab to OUT/corpus.json."""
        print(f"lowcomm: corpus: {self.description}", file=sys.stderr, flush=True)
        record = {
            "name": self.name,
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
            "vocab_size": self.vocab_size,
            "description": self.description,
        }
        (Path(out_dir) / "corpus.json").write_text(json.dumps(record, indent=2) + "\n")

    def retokenized(self, tokens: BPETokens) -> Corpus:
        """This byte corpus as the BPE ``tokens`` (from lowcomm.train.tokenizer) re-encode it."""
        desc = (
            f"{self.description}; re-tokenized with a byte-level BPE of {tokens.vocab_size} "
            f"tokens trained on the train split: {len(tokens.train)} train / {len(tokens.val)} "
            f"val tokens ({tokens.bytes_per_token:.2f} bytes per token); "
            f"tokenizer {tokens.tokenizer_file}"
        )
        return dataclasses.replace(
            self,
            train=tokens.train,
            val=tokens.val,
            vocab_size=tokens.vocab_size,
            description=desc,
            tokenizer_file=tokens.tokenizer_file,
        )


def load_corpus(
    spec: str | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int | None = None,
    tokenizer: str = "bytes",
) -> Corpus:
    """Load the corpus named by `spec` (see the module docstring for accepted forms).

    ``tokenizer="bpe:N"`` re-tokenizes a text corpus with a byte-level BPE trained on it
    (lowcomm.train.tokenizer; cached).
    """
    if tokenizer != "bytes":
        from .tokenizer import apply_tokenizer

        corpus = load_corpus(spec, max_bytes=max_bytes, vocab_size=vocab_size)
        return apply_tokenizer(corpus, tokenizer)
    if spec is None or spec == "stdlib":
        return _load_stdlib(max_bytes)
    if spec.startswith("hf:"):
        name, _, config = spec[3:].partition(":")
        if not name:
            raise ConfigError(f"empty dataset name in {spec!r}; expected 'hf:NAME[:CONFIG]'")
        return _load_hf(name, config or None, max_bytes)
    path, dtype = _split_dtype(spec)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; {_ACCEPTED}")
    if path.suffix == ".bin":
        return _load_bin(path, dtype or "uint16", vocab_size)
    if dtype is not None:
        raise ConfigError(
            f"a dtype suffix is only meaningful for .bin token arrays, not {str(path)!r}"
        )
    if path.is_dir():
        return _load_folder(path, max_bytes)
    return _load_text_file(path)


def _split_dtype(spec: str) -> tuple[Path, str | None]:
    """'X.bin:uint16' -> (X.bin, 'uint16'); a dtype-like suffix we do not read is a ConfigError."""
    head, sep, tail = spec.rpartition(":")
    if not sep or not head:
        return Path(spec), None
    if tail in BIN_DTYPES:
        return Path(head), tail
    if re.fullmatch(r"(u?int|float|bfloat|i|u|f)\d*", tail) and not Path(spec).exists():
        raise ConfigError(
            f"unknown token dtype '{tail}' in '{spec}': token arrays are "
            f"{', '.join(BIN_DTYPES)} (e.g. data={head}:uint16)"
        )
    return Path(spec), None


def repeat_warning(corpus: Corpus, tokens_needed: int, limit: float = 10.0) -> str | None:
    """A warning when training reads each train token more than ``limit`` times, else None."""
    passes = tokens_needed / max(len(corpus.train), 1)
    if passes <= limit:
        return None
    return (
        f"the corpus has {len(corpus.train):,} train tokens and the run reads "
        f"{tokens_needed:,}: every token about {passes:.0f} times, so the model will mostly "
        f"memorize it; give a bigger corpus or fewer steps"
    )


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Path, list[Path]]:
    """The stdlib root and its *.py files read by the default corpus, in their fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[bool, str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune while walking: site-packages can be many times the size of the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for fname in filenames:
            if fname.endswith(".py"):
                path = Path(dirpath, fname)
                rel = path.relative_to(root)
                found.append((bool(_TEST_DIRS.intersection(rel.parts[:-1])), rel.as_posix(), path))
    found.sort()
    return root, _take_until(max_bytes, [path for _, _, path in found])


def split_files(root: Path, files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Split files into (train, val): a file is val iff the hash of its relative path says so."""
    # A hash of the path, not the position in the list, so adding or removing one file (another
    # Python version, a new document) never moves the others between train and val.
    train, val = [], []
    for path in files:
        rel = path.relative_to(root).as_posix().encode()
        digest = int.from_bytes(hashlib.sha1(rel).digest()[:8], "little")
        (val if digest % VAL_EVERY == 0 else train).append(path)
    return train, val


class Batches:
    """Random training windows from this worker's disjoint shard; batch s depends on
    (seed, rank, s) only.

    Shards (``shard``):
      - ``striped`` (default): the tokens are cut into blocks of ``block_tokens`` dealt round-robin
        to the workers, so shards are disjoint yet each spans the whole corpus (IID-like data,
        as in DiLoCo's main experiments);
      - ``contiguous``: worker r gets the r-th of ``world_size`` equal slices. On a corpus sorted
        by path (the stdlib) the workers then see different kinds of code: non-IID data, which
        hurts local-update methods much more than per-step averaging.
    A window never crosses a block (striped) or shard (contiguous) edge.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shard: str = "striped",
        block_tokens: int = 65536,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(
                f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if shard not in ("striped", "contiguous"):
            raise ValueError(f"shard must be striped or contiguous, got {shard!r}")
        shard_len = len(tokens) // world_size
        if shard_len < seq_len + 1:
            raise ConfigError(
                f"each of {world_size} shards has {shard_len} tokens ({len(tokens)} in all), "
                f"fewer than seq_len + 1 = {seq_len + 1}; "
                "use a bigger corpus, fewer workers or a shorter seq_len"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shard = shard
        if shard == "contiguous":
            self.block_len = shard_len
            self.blocks = np.array([rank * shard_len], dtype=np.int64)
        else:
            # blocks no longer than a shard (small corpora) and long enough for a few windows
            self.block_len = max(min(block_tokens, shard_len), seq_len + 1)
            n_blocks = len(tokens) // self.block_len
            self.blocks = np.arange(rank, n_blocks, world_size, dtype=np.int64) * self.block_len
        self.shard_start = int(self.blocks[0])
        """Offset of this worker's first block in `tokens`."""
        self.shard_len = shard_len
        self.step = 0
        """Index of the batch the next call to `next()` returns."""

    def owned_ranges(self) -> list[tuple[int, int]]:
        """The [start, end) token ranges this worker samples from."""
        return [(int(b), int(b) + self.block_len) for b in self.blocks]

    def window_starts(self, step: int) -> np.ndarray:
        """Offsets in `tokens` of the batch_size windows (seq_len + 1 tokens each) of batch
        `step`."""
        # A fresh generator per step, seeded by (seed, rank, step): any batch can be recomputed
        # from its step alone, so resuming needs no sampler state but the counter.
        rng = np.random.default_rng((self.seed, self.rank, step))
        block = self.blocks[rng.integers(0, len(self.blocks), size=self.batch_size)]
        return block + rng.integers(0, self.block_len - self.seq_len, size=self.batch_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [batch_size, seq_len] of batch `step`, without advancing."""
        idx = self.window_starts(step)[:, None] + np.arange(self.seq_len + 1)
        windows = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the current step, then advance the step."""
        out = self.batch(self.step)
        self.step += 1
        return out

    __next__ = next

    def __iter__(self) -> Batches:
        """Iterate forever over successive batches."""
        return self

    def state_dict(self) -> dict[str, int]:
        """Everything needed to resume: the step counter."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a `state_dict()`."""
        self.step = int(state["step"])


def val_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of n_batches (x, y) validation batches, identical on every worker."""
    n_starts = len(tokens) - seq_len  # windows are seq_len + 1 tokens long
    if n_starts < 1:
        raise ConfigError(
            f"validation set has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
        )
    n = batch_size * n_batches
    # Stratified: one random window per equal slice of the val set, so even a few batches cover
    # all of it and the estimate has less variance than independent draws.
    edges = np.linspace(0, n_starts, n + 1).astype(np.int64)
    rng = np.random.default_rng(seed)
    starts = edges[:-1] + rng.integers(0, np.maximum(edges[1:] - edges[:-1], 1))
    idx = starts[:, None] + np.arange(seq_len + 1)
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64)).view(
        n_batches, batch_size, seq_len + 1
    )
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


# --- loaders -------------------------------------------------------------------------------------


def _take_until(max_bytes: int, files: list[Path]) -> list[Path]:
    """The longest prefix of files whose total size stays within max_bytes."""
    taken, total = [], 0
    for path in files:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        taken.append(path)
        total += size
    return taken


def _bytes_to_tokens(chunks: list[bytes]) -> np.ndarray:
    """Concatenate documents, one newline between them, as uint8 byte tokens."""
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def _split_tail(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a single stream into (first 95%, last 5%)."""
    cut = len(tokens) - len(tokens) // VAL_EVERY
    return tokens[:cut], tokens[cut:]


def _load_stdlib(max_bytes: int) -> Corpus:
    """The running interpreter's standard library sources, byte-tokenised, split by file."""
    root, files = stdlib_files(max_bytes)
    train_files, val_files = split_files(root, files)
    train = _bytes_to_tokens([p.read_bytes() for p in train_files])
    val = _bytes_to_tokens([p.read_bytes() for p in val_files])
    desc = (
        f"Python {platform.python_version()} standard library at {root}: {len(files)} *.py files, "
        f"{len(train)} train / {len(val)} val byte tokens; "
        f"val = {len(val_files)} files picked by path hash"
    )
    return Corpus(train=train, val=val, vocab_size=256, name="stdlib", description=desc)


def _load_text_file(path: Path) -> Corpus:
    """One text file as bytes; its last 5% is validation."""
    tokens = np.fromfile(path, dtype=np.uint8)
    if len(tokens) == 0:
        raise ConfigError(f"corpus file {str(path)!r} is empty")
    _check_text(path, tokens)
    train, val = _split_tail(tokens)
    desc = (
        f"text file {path}: {len(train)} train / {len(val)} val byte tokens; "
        f"val = last 1/{VAL_EVERY}"
    )
    return Corpus(train=train, val=val, vocab_size=256, name=path.name, description=desc)


_MAX_NOT_TEXT = 0.01
"""Largest fraction of undecodable or NUL bytes a text corpus may have."""


def _check_text(path: Path, data: np.ndarray) -> None:
    """ConfigError unless ``data`` reads as UTF-8 text (a few stray bytes are tolerated)."""
    head = data[: 1 << 22].tobytes()  # the first 4 MB tell text from binary
    text = head.decode("utf-8", errors="replace")
    bad = (text.count("\ufffd") + head.count(0)) / max(len(head), 1)
    if bad > _MAX_NOT_TEXT:
        raise ConfigError(
            f"corpus file {str(path)!r} is not UTF-8 text ({bad:.0%} of its bytes are not): "
            f"if it holds token ids, give it a .bin name ({path.with_suffix('.bin').name}, read "
            f"as uint16; add :uint8 or :uint32 for others); else give UTF-8 text or data=stdlib"
        )


def _load_folder(root: Path, max_bytes: int) -> Corpus:
    """Every non-hidden UTF-8 file under root, split by file (by tail if the hash split is
    one-sided)."""
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git and friends
        candidates += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    texts: dict[Path, bytes] = {}
    skipped = 0
    for path in _take_until(max_bytes, candidates):
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1  # binary files (images, archives) are not text to train on
            continue
        texts[path] = data
    if not texts:
        raise ConfigError(f"corpus folder {str(root)!r} holds no readable UTF-8 text files")
    train_files, val_files = split_files(root, list(texts))
    if train_files and val_files:
        train = _bytes_to_tokens([texts[p] for p in train_files])
        val = _bytes_to_tokens([texts[p] for p in val_files])
        how = f"{len(val_files)} files picked by path hash"
    else:
        # Too few files for the hash to put some on each side: fall back to the stream's tail.
        train, val = _split_tail(_bytes_to_tokens(list(texts.values())))
        how = f"last 1/{VAL_EVERY} (too few files to split by file)"
    desc = (
        f"folder {root}: {len(texts)} text files ({skipped} non-UTF-8 skipped), "
        f"{len(train)} train / {len(val)} val byte tokens; val = {how}"
    )
    return Corpus(train=train, val=val, vocab_size=256, name=root.name, description=desc)


def _memmap(path: Path, dtype: str) -> np.ndarray:
    """A read-only memory map of a raw token file."""
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        raise ConfigError(
            f"token file {str(path)!r} has {size} bytes, "
            f"not a positive multiple of {dtype}'s {itemsize}"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _load_bin(path: Path, dtype: str, vocab_size: int | None) -> Corpus:
    """A pre-tokenized token array, memory-mapped so it never has to fit in RAM."""
    tokens = _memmap(path, dtype)
    val_path = path.with_name("val.bin")
    if path.name == "train.bin" and val_path.exists():
        train, val = tokens, _memmap(val_path, dtype)
        how = f"sibling {val_path.name}"
    else:
        train, val = _split_tail(tokens)
        how = f"last 1/{VAL_EVERY}"
    if vocab_size is None:
        # One pass over the file; pass vocab_size to skip it on huge arrays.
        vocab_size = int(max(train.max(), val.max() if len(val) else 0)) + 1
    desc = (
        f"token array {path} ({dtype}): {len(train)} train / {len(val)} val tokens, "
        f"vocab {vocab_size}; val = {how}"
    )
    return Corpus(train=train, val=val, vocab_size=vocab_size, name=path.stem, description=desc)


def _load_hf(name: str, config: str | None, max_bytes: int) -> Corpus:
    """A Hugging Face dataset's `text` field as bytes, streamed up to max_bytes per split."""
    try:
        import datasets  # optional extra: imported here so the core package never needs it
    except ImportError as err:
        raise ImportError(
            f"corpus 'hf:{name}' needs the optional Hugging Face `datasets` package: "
            "pip install 'lowcomm[hf]'"
        ) from err

    def read(split: str) -> np.ndarray:
        # Streaming: a web-scale dataset is read only up to the cap, never downloaded whole.
        chunks, total = [], 0
        for row in datasets.load_dataset(name, config, split=split, streaming=True):
            if "text" not in row:
                raise ConfigError(
                    f"dataset {name!r} has no 'text' field; its fields are {sorted(row)}"
                )
            data = row["text"].encode("utf-8")
            chunks.append(data)
            total += len(data) + 1
            if total >= max_bytes:
                break
        return _bytes_to_tokens(chunks)

    splits = datasets.get_dataset_split_names(name, config)
    val_split = next((s for s in ("validation", "valid", "test") if s in splits), None)
    if val_split is not None:
        train, val = read("train"), read(val_split)
        how = f"split {val_split!r}"
    else:
        train, val = _split_tail(read("train"))
        how = f"last 1/{VAL_EVERY} of 'train'"
    desc = (
        f"Hugging Face dataset {name}{':' + config if config else ''}: "
        f"{len(train)} train / {len(val)} val byte tokens; val = {how}"
    )
    return Corpus(train=train, val=val, vocab_size=256, name=name, description=desc)
