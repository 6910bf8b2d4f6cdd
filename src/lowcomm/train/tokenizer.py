"""Subword tokens: a byte-level BPE tokenizer trained locally on the corpus with HF ``tokenizers``.

``tokenizer=bpe:N`` trains a byte-level BPE of N tokens on the train split only (so validation
text never shapes the vocabulary), then encodes both splits. Tokenizer and token arrays are cached
under ``$LOWCOMM_CACHE`` (default ``~/.cache/lowcomm``) in ``bpe/<corpus hash>-<N>/``, keyed by a
hash of the corpus tokens and N; workers of one machine share one training through a file lock.
``tokenizer.json`` there loads with ``tokenizers.Tokenizer.from_file`` or
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError

__all__ = [
    "parse_tokenizer",
    "cache_root",
    "BPETokens",
    "bpe_encode",
    "bpe_corpus",
    "apply_tokenizer",
    "BYTES",
]

BYTES = "bytes"
"""The default tokenizer: one token per byte (vocab 256), nothing to train."""
_CHUNK = 1 << 16  # characters per piece handed to the trainer and encoder (keeps memory flat)
_VERSION = 1  # bump when the training recipe changes, so old caches are not reused


def parse_tokenizer(spec: str) -> int | None:
    """None for byte tokens, else the vocabulary size N of ``bpe:N``; ConfigError otherwise."""
    if spec == BYTES:
        return None
    kind, _, size = spec.partition(":")
    if kind != "bpe" or not size.isdigit():
        raise ConfigError(
            f"unknown tokenizer '{spec}': use tokenizer=bytes or tokenizer=bpe:N (e.g. bpe:4096)"
        )
    n = int(size)
    if not 257 <= n <= 2**31:
        raise ConfigError(
            f"tokenizer=bpe:{n} needs 257 <= N (256 byte tokens plus merges): use e.g. bpe:4096"
        )
    return n


def cache_root() -> Path:
    """Where tokenizers and encoded corpora are cached: $LOWCOMM_CACHE or ~/.cache/lowcomm."""
    return Path(os.environ.get("LOWCOMM_CACHE") or Path.home() / ".cache" / "lowcomm")


@dataclass(frozen=True)
class BPETokens:
    """Both splits of a byte corpus encoded with one byte-level BPE (memory-mapped, cached)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    """Tokens of the trained tokenizer (at most the N asked for)."""
    bytes_per_token: float
    """Train bytes per train token: how much the merges shorten the text."""
    tokenizer_file: str
    """The ``tokenizers`` JSON file (``tokenizers.Tokenizer.from_file`` loads it)."""


class _Retokenizable(Protocol):
    """What :func:`apply_tokenizer` needs of a corpus (lowcomm.train.data.Corpus has it)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str

    def retokenized(self, tokens: BPETokens) -> Any: ...


def apply_tokenizer(corpus: _Retokenizable, spec: str, cache: Path | None = None) -> Any:
    """The corpus re-tokenized as ``spec`` says (unchanged for ``bytes``).

    ``corpus`` is a :class:`lowcomm.train.data.Corpus`; the corpus builds its re-tokenized self
    from the :class:`BPETokens` (so this module never imports the data module).
    """
    n = parse_tokenizer(spec)
    if n is None:
        return corpus
    if corpus.vocab_size != 256:
        raise ConfigError(
            f"tokenizer={spec} applies to text corpora, but {corpus.name} is already "
            f"tokenized (vocab {corpus.vocab_size}): drop the tokenizer setting"
        )
    return bpe_corpus(corpus, n, cache)


def bpe_corpus(corpus: _Retokenizable, vocab_size: int, cache: Path | None = None) -> Any:
    """The byte corpus encoded with a byte-level BPE of ``vocab_size`` tokens (trained, or
    read from the cache)."""
    return corpus.retokenized(bpe_encode(corpus.train, corpus.val, vocab_size, corpus.name, cache))


def _corpus_hash(train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256(f"v{_VERSION}".encode())
    for part in (train, val):
        h.update(len(part).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(part, dtype=np.uint8).data)
    return h.hexdigest()[:16]


def _pieces(tokens: np.ndarray) -> Iterator[str]:
    """The byte tokens as text pieces cut after a newline near every _CHUNK bytes."""
    data = np.asarray(tokens, dtype=np.uint8).tobytes()
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + _CHUNK)
        end = len(data) if end < 0 else end + 1
        # bytes that are not UTF-8 become U+FFFD: byte-level BPE works on text
        yield data[start:end].decode("utf-8", errors="replace")
        start = end


def _train(train: np.ndarray, vocab_size: int) -> object:
    """A byte-level BPE tokenizer of vocab_size tokens trained on the byte tokens ``train``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as err:
        raise ConfigError(
            "tokenizer=bpe:N needs Hugging Face tokenizers: pip install 'lowcomm[hf]'"
        ) from err
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_pieces(train), trainer)
    return tok


def _encode(tok: object, tokens: np.ndarray, dtype: str) -> np.ndarray:
    ids = [np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch(list(_pieces(tokens)))]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)


def bpe_encode(
    train: np.ndarray, val: np.ndarray, vocab_size: int, source: str, cache: Path | None = None
) -> BPETokens:
    """Byte tokens ``train`` and ``val`` encoded with a byte-level BPE of ``vocab_size`` tokens
    trained on ``train`` (or read from the cache; ``source`` names the corpus in its meta.json)."""
    key = f"{_corpus_hash(train, val)}-{vocab_size}"
    folder = (cache or cache_root()) / "bpe" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker trains; the others wait, then read the cache
        if not (folder / "meta.json").exists():
            _build_cache(train, val, source, vocab_size, folder)
    meta = json.loads((folder / "meta.json").read_text())
    return BPETokens(
        train=np.memmap(folder / "train.bin", dtype=meta["dtype"], mode="r"),
        val=np.memmap(folder / "val.bin", dtype=meta["dtype"], mode="r"),
        vocab_size=meta["vocab_size"],
        bytes_per_token=meta["bytes_per_token"],
        tokenizer_file=str(folder / "tokenizer.json"),
    )


def _build_cache(
    byte_train: np.ndarray, byte_val: np.ndarray, source: str, vocab_size: int, folder: Path
) -> None:
    """Train, encode both splits, and write them to ``folder`` (meta.json last: it marks done)."""
    tok = _train(byte_train, vocab_size)
    vocab = tok.get_vocab_size()
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    train, val = _encode(tok, byte_train, dtype), _encode(tok, byte_val, dtype)
    train.tofile(tmp / "train.bin")
    val.tofile(tmp / "val.bin")
    meta = {
        "vocab_size": vocab,
        "dtype": dtype,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "bytes_per_token": (len(byte_train) / max(len(train), 1)),
        "source": source,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if folder.exists():  # a half-written folder from a killed run
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)
