"""Configuration as dataclasses: every knob of docs/algorithms.md's table, one name per knob.

Each field carries its help text in ``metadata["help"]``; the CLI's ``--help`` and the
``key=value`` override parser read it from there, so docs and code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from .errors import ConfigError  # noqa: F401  (re-exported: the historical import path)

# The closed choices of SyncConfig: one list each (the Literal is the list).
FragmentPattern = Literal["strided", "sequential"]
Codec = Literal[
    "fp32", "bf16", "fp16", "int8", "int4", "int2", "fp4", "topk", "loco", "int4-authors"
]
Reduce = Literal["auto", "allreduce", "gather", "two-phase"]
Aggregation = Literal["auto", "mean", "selected-mean"]
Compensation = Literal["none", "ef", "loco"]
OuterKind = Literal["nesterov", "sgd", "co2"]
ClipMode = Literal["element", "norm"]
Merge = Literal["alpha", "continue"]
CO2Merge = Literal["continue", "reset"]
Buffers = Literal["average", "broadcast", "local"]
StateDevice = Literal["cpu", "model"]
LocoQuantizer = Literal["ours", "authors"]
Shard = Literal["striped", "contiguous"]
DdpHook = Literal["allreduce", "bf16", "powersgd"]
LogTo = Literal["none", "tensorboard"]
InnerParallel = Literal["fsdp", "ddp"]

CODECS: tuple[str, ...] = get_args(Codec)
DENSE_CODECS = ("fp32", "bf16", "fp16")


def knob(default: Any, help: str) -> Any:
    """A dataclass field whose help text doubles as CLI documentation."""
    return field(default=default, metadata={"help": help})


@dataclass
class SyncConfig:
    """How workers synchronise: the one engine's knobs (docs/algorithms.md,
    'One engine, not five')."""

    sync_every: int = knob(100, "H: inner steps between two syncs of the same parameters (>= 1).")
    fragments: int = knob(
        1,
        "P: number of fragments, counting the embeddings+norm+head fragment "
        "when P >= 2. P = 1 syncs the whole model at once (plain DiLoCo).",
    )
    blocks_per_fragment: int = knob(
        0,
        "Blocks per fragment; when > 0 it sets P instead of `fragments` (Streaming DiLoCo used 3).",
    )
    fragment_pattern: FragmentPattern = knob(
        "strided",
        "How blocks map to fragments: strided (block b -> "
        "fragment b mod (P-1)) or sequential (consecutive runs).",
    )
    overlap: int = knob(
        0,
        "tau: inner steps a fragment's collective stays in flight before its "
        "result is applied. 0 = blocking; tau < H/P; -1 (or tau = H, with P = 1) "
        "is CO2's whole-round overlap.",
    )
    alpha: float = knob(
        0.0,
        "Merge weight after an overlapped sync: theta <- alpha*theta_local + "
        "(1-alpha)*theta_global. 0 discards the tau local steps, 0.5 averages.",
    )
    merge: Merge = knob(
        "alpha",
        "How an overlapped result (tau >= 1) enters the local weights: alpha "
        "(the alpha-mix above) or continue (the new global copy plus the "
        "steps taken since the send). CO2's whole-round overlap uses co2_merge.",
    )
    codec: Codec = knob(
        "fp32", "What goes on the wire: fp32|bf16|fp16|int8|int4|int2|fp4|topk|loco|int4-authors."
    )
    codec_block: int = knob(128, "Elements per scale block for the int-k and fp4 codecs.")
    density: float = knob(
        1 / 64, "Top-k codec: fraction of entries kept per chunk (1/64 = 64 of 4096)."
    )
    value_bits: int = knob(2, "Top-k codec: bits per kept value (2 = 4-entry lookup of bin means).")
    reduce: Reduce = knob(
        "auto",
        "Collective for the outer gradient: allreduce (dense codecs), gather "
        "(all-gather + FP32 sum), two-phase (all-to-all reduce-scatter + "
        "all-gather), or auto (allreduce for fp32/bf16/fp16, gather otherwise).",
    )
    aggregation: Aggregation = knob(
        "auto",
        "Top-k aggregation: selected-mean (each entry averaged "
        "over the workers that sent it, as the SparseLoCo authors' code "
        "does; measured better), mean (1/M sum of decoded payloads), or "
        "auto (selected-mean for codec=topk, mean otherwise).",
    )
    compensation: Compensation = knob(
        "none",
        "Error compensation of what is sent: none, ef (error feedback, "
        "SparseLoCo) or loco (moving average, LoCo).",
    )
    error_decay: float = knob(0.95, "beta of error feedback: e <- beta*e + delta.")
    outer_optimizer: OuterKind = knob(
        "nesterov",
        "Outer optimizer on the global copy: nesterov, sgd "
        "(plain, SparseLoCo) or co2 (momentum + penalty + clip).",
    )
    outer_lr: float = knob(0.7, "Outer learning rate.")
    outer_momentum: float = knob(0.9, "Outer momentum.")
    nesterov: bool = knob(True, "Use Nesterov momentum in the outer optimizer.")
    staleness_penalty: bool = knob(
        False,
        "CO2: damp the stale pseudo-gradient element-wise by how "
        "far the global parameters moved (Gap-Aware form).",
    )
    co2_merge: CO2Merge = knob(
        "continue",
        "CO2: continue (each worker keeps co2_keep of its own progress of "
        "the round in flight on top of the newest global model) or reset "
        "(restart every round from the one-round-stale global model; the "
        "earlier rule, kept as an ablation).",
    )
    co2_keep: float = knob(
        0.75,
        "CO2 continue: the fraction of its own round in flight a worker "
        "keeps until the round's average lands (1: all of it; 1/M: the "
        "eager-updates rule; 0: same as reset).",
    )
    momentum_clip: float = knob(0.0, "CO2: clip the outer momentum at phi (0 = off).")
    momentum_clip_mode: ClipMode = knob(
        "element", "CO2: clip element-wise to +-phi (element) or the L2 norm to phi (norm)."
    )
    loco_bits: int = knob(4, "LoCo strategy: bits per gradient value (8, 4 or 2).")
    loco_beta: float = knob(0.8, "LoCo: moving-average weight of the compensation buffer.")
    loco_reset_every: int = knob(
        1024,
        "LoCo: zero the compensation buffers every N optimizer steps "
        "(0 = never; 1024 is the LoCo authors' period).",
    )
    loco_quantizer: LocoQuantizer = knob(
        "ours",
        "LoCo per-step hooks: ours (absmax/7, codes -7..7, groups of "
        "codec_block) or authors (absmax/8, codes -8..7, one group per "
        "min(rows, cols)); ours is the default (measured: equal loss, fewer bytes).",
    )
    loco_compress_1d: bool = knob(
        False,
        "LoCo per-step hooks: quantise 1-D tensors (biases, norms) "
        "too; by default they are sent as FP32, as the authors do.",
    )
    nonfinite_patience: int = knob(
        3,
        "Stop the run after this many syncs in a row in which some worker's "
        "pseudo-gradient was non-finite and left out (1 = stop at the first).",
    )
    replica_check_every: int = knob(
        10,
        "Every N syncs, compare a hash of the global parameters across "
        "workers; a mismatch stops the run (0 = never).",
    )
    state_device: StateDevice = knob(
        "cpu", "Where the global copy and outer state live: cpu or the model's device (model)."
    )
    bucket_mb: float = knob(64.0, "Largest flat buffer handed to one collective, in MiB.")
    buffers: Buffers = knob(
        "average",
        "Module buffers (e.g. BatchNorm statistics): average (floating "
        "buffers averaged in FP32 at every sync, integer ones broadcast "
        "from rank 0), broadcast (all from rank 0 at every sync) or local "
        "(never synced).",
    )

    def __post_init__(self) -> None:
        self.validate()

    def __getitem__(self, key: str) -> Any:
        """Read a knob by name (``cfg["sync_every"]``), as scripts written against dicts do."""
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def validate(self) -> SyncConfig:
        """Raise ConfigError on any setting that cannot work; return self."""
        check_types(self)
        if self.sync_every < 1:
            raise ConfigError(
                f"sync_every (H) must be >= 1, got {self.sync_every}: set sync_every=1 or more"
            )
        if self.fragments < 1:
            raise ConfigError(f"fragments (P) must be >= 1, got {self.fragments}")
        if self.blocks_per_fragment < 0:
            raise ConfigError(f"blocks_per_fragment must be >= 0, got {self.blocks_per_fragment}")
        if self.blocks_per_fragment > 0 and self.fragments > 1:
            raise ConfigError(
                f"fragments={self.fragments} and blocks_per_fragment="
                f"{self.blocks_per_fragment} both set P: give one (blocks_per_fragment=0 "
                f"to use the count)"
            )
        if self.overlap < -1:
            raise ConfigError(
                f"overlap (tau) must be >= 0, or -1 for a whole round; got {self.overlap}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 < self.density <= 1.0:
            raise ConfigError(f"density must be in (0, 1], got {self.density}")
        if self.value_bits not in (1, 2, 4, 8, 32):
            raise ConfigError(f"value_bits must be one of 1, 2, 4, 8, 32; got {self.value_bits}")
        if not 0.0 <= self.error_decay <= 1.0:
            raise ConfigError(f"error_decay must be in [0, 1], got {self.error_decay}")
        if not 0.0 <= self.loco_beta < 1.0:
            raise ConfigError(f"loco_beta must be in [0, 1), got {self.loco_beta}")
        if self.loco_bits not in (2, 4, 8):
            raise ConfigError(f"loco_bits must be 2, 4 or 8, got {self.loco_bits}")
        if self.outer_lr <= 0:
            raise ConfigError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.co2_keep <= 1.0:
            raise ConfigError(f"co2_keep must be in [0, 1], got {self.co2_keep}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.momentum_clip < 0:
            raise ConfigError(f"momentum_clip must be >= 0 (0 = off), got {self.momentum_clip}")
        if self.nonfinite_patience < 1:
            raise ConfigError(f"nonfinite_patience must be >= 1, got {self.nonfinite_patience}")
        if self.replica_check_every < 0:
            raise ConfigError(f"replica_check_every must be >= 0, got {self.replica_check_every}")
        if self.codec_block < 1:
            raise ConfigError(f"codec_block must be >= 1, got {self.codec_block}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.reduce == "allreduce" and self.codec not in DENSE_CODECS:
            raise ConfigError(
                f"reduce=allreduce needs a dense codec ({', '.join(DENSE_CODECS)}), "
                f"got codec={self.codec}: use reduce=gather or reduce=two-phase"
            )
        if self.aggregation == "selected-mean" and self.codec != "topk":
            raise ConfigError(
                f"aggregation=selected-mean needs codec=topk (got codec={self.codec}): "
                f"use aggregation=mean or auto"
            )
        if self.reduce == "two-phase" and self.codec == "topk":
            raise ConfigError(
                "reduce=two-phase needs an element-wise codec; top-k tiles whole "
                "tensors: use reduce=gather"
            )
        return self

    @property
    def resolved_aggregation(self) -> str:
        """``aggregation`` with auto resolved: selected-mean for top-k payloads, mean otherwise."""
        if self.aggregation != "auto":
            return self.aggregation
        return "selected-mean" if self.codec == "topk" else "mean"

    @property
    def tau(self) -> int:
        """The overlap in inner steps, with -1 resolved to a whole round (H)."""
        return self.sync_every if self.overlap == -1 else self.overlap

    def check_schedule(self, n_fragments: int) -> None:
        """Overlap constraints that depend on the resolved number of fragments."""
        H, tau = self.sync_every, self.tau
        if tau == 0:
            return
        if tau == H and n_fragments == 1:
            return  # CO2: the whole round overlaps the next one
        if tau * n_fragments >= H:
            raise ConfigError(
                f"overlap (tau={tau}) must be < H/P = {H}/{n_fragments}: "
                f"a fragment's result must land before the next fragment is sent; "
                f"lower overlap, raise sync_every or use fewer "
                f"fragments (or overlap=sync_every with fragments=1 for CO2's whole-round overlap)"
            )


_LITERALS = {
    "FragmentPattern": FragmentPattern,
    "Codec": Codec,
    "Reduce": Reduce,
    "Aggregation": Aggregation,
    "Compensation": Compensation,
    "OuterKind": OuterKind,
    "ClipMode": ClipMode,
    "Merge": Merge,
    "CO2Merge": CO2Merge,
    "Buffers": Buffers,
    "StateDevice": StateDevice,
    "LocoQuantizer": LocoQuantizer,
    "Shard": Shard,
    "DdpHook": DdpHook,
    "LogTo": LogTo,
    "InnerParallel": InnerParallel,
}


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} '{value}': choose one of {', '.join(allowed)}")


def check_types(cfg: Any) -> None:
    """ConfigError unless every field of the dataclass ``cfg`` holds a value of its declared kind.

    ints must be ints (not bools, not 10.5), floats may be given as ints, bools must be bools,
    and Literal fields one of their choices; the message names the field and what to pass.
    """
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind in _LITERALS:
            allowed = get_args(_LITERALS[kind])
            if not isinstance(value, str):
                raise ConfigError(f"{f.name} must be one of {', '.join(allowed)}; got {value!r}")
            _choice(f.name, value, allowed)
        elif kind == "bool" and not isinstance(value, bool):
            raise ConfigError(f"{f.name} must be True or False, got {value!r}")
        elif kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{f.name} must be a whole number, got {value!r}")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{f.name} must be a number, got {value!r}")
            object.__setattr__(cfg, f.name, float(value))
        elif kind == "str" and not isinstance(value, str):
            raise ConfigError(f"{f.name} must be a string, got {value!r}")


@dataclass
class TrainConfig:
    """The reference trainer's knobs (model, data, inner optimizer, logging, run control)."""

    def __post_init__(self) -> None:
        validate_train(self)

    model: str = knob(
        "small",
        "Model preset: tiny, small, base or 124m; or a Hugging Face causal LM: "
        "hf:ARCH[:PRESET] (llama, gpt2, qwen2, ... at a preset's size) or "
        "hf:PATH (a local folder); needs lowcomm[hf].",
    )
    data: str = knob(
        "stdlib",
        "Corpus: stdlib (the Python standard library's source), a text file "
        "or folder, a token .bin file, or hf:NAME[:CONFIG].",
    )
    tokenizer: str = knob(
        "bytes",
        "Tokens of a text corpus: bytes (one per byte, vocab 256) or bpe:N "
        "(a byte-level BPE of N tokens trained on the corpus, cached; "
        "needs lowcomm[hf]).",
    )
    shard: Shard = knob(
        "striped",
        "How the train tokens are split between workers: striped (disjoint "
        "64K-token blocks dealt round-robin: IID-like) or contiguous (one "
        "slice each: non-IID on a corpus sorted by path).",
    )
    steps: int = knob(500, "Inner optimizer steps per worker.")
    batch_size: int = knob(16, "Sequences per worker per step.")
    ranks_per_worker: int = knob(
        1,
        "Ranks that train one worker's replica together with FSDP2 "
        "(a worker is a site); lowcomm's outer loop runs between workers. "
        "batch_size stays per worker: each rank takes batch_size / N rows.",
    )
    inner_parallel: InnerParallel = knob(
        "fsdp",
        "With ranks_per_worker > 1: fsdp (FSDP2 shards the model over the worker's ranks; "
        "ddp becomes HSDP) or ddp (each rank holds the whole model; DDP inside the worker, "
        "each rank syncs 1/N of every weight between workers; ddp is DDP over all ranks).",
    )
    seq_len: int = knob(128, "Tokens per sequence.")
    inner_lr: float = knob(3e-3, "Peak AdamW learning rate of the inner optimizer.")
    warmup_steps: int = knob(50, "Linear warm-up steps, then cosine decay.")
    min_lr_ratio: float = knob(0.1, "Cosine decay floor as a fraction of inner_lr.")
    weight_decay: float = knob(0.1, "AdamW weight decay.")
    beta1: float = knob(0.9, "AdamW beta1.")
    beta2: float = knob(0.95, "AdamW beta2.")
    grad_clip: float = knob(1.0, "Clip the gradient norm to this (0 = off).")
    seed: int = knob(0, "Seed of model init and data order; the same seed gives the same run.")
    eval_every: int = knob(
        100, "Validation loss on the global parameters every N steps (0 = only at the end)."
    )
    eval_batches: int = knob(16, "Validation batches per evaluation (split across workers).")
    log_every: int = knob(10, "Write a metrics.jsonl record every N steps.")
    threads: int = knob(1, "Compute threads per worker on CPU.")
    timeout_s: float = knob(300.0, "Collective timeout: a peer silent this long stops the run.")
    checkpoint_every: int = knob(
        0, "Checkpoint every N inner steps, at the next sync boundary (0 = off)."
    )
    device: str = knob("auto", "cpu, cuda, or auto (cuda when available).")
    ddp_hook: DdpHook = knob(
        "allreduce",
        "DDP strategy: gradient hook: allreduce (FP32, lowcomm's), bf16 "
        "(PyTorch's bf16_compress_hook) or powersgd (PyTorch's PowerSGD hook).",
    )
    powersgd_rank: int = knob(1, "DDP with ddp_hook=powersgd: matrix approximation rank.")
    powersgd_start: int = knob(
        10, "DDP with ddp_hook=powersgd: plain all-reduce for this many steps first."
    )
    progress: bool = knob(
        True,
        "Show progress on rank 0: a bar when stderr is a terminal, else "
        "one plain line every log_every steps.",
    )
    log: LogTo = knob(
        "none",
        "Also log to: none or tensorboard (DIR/tensorboard/; needs "
        "pip install 'lowcomm[tensorboard]').",
    )


SAVED_BEFORE: dict[str, Any] = {"co2_keep": 1.0}
"""Knobs added after runs were saved, each with the value that reproduces such a run: a
checkpoint that lacks one resumes with the behaviour it was trained with, not today's default."""


def config_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every config key -> (owning dataclass, field): the one namespace of `key=value`."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in (SyncConfig, TrainConfig):
        for f in fields(cls):
            out[f.name] = (cls, f)
    return out


def _coerce(name: str, f: dataclasses.Field, raw: Any) -> Any:
    kind = type(f.default)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    if isinstance(raw, (int, float)) and kind is float and not isinstance(raw, bool):
        return float(raw)
    text = str(raw).strip()
    try:
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            if "/" in text:  # density=1/64 reads naturally
                num, den = text.split("/", 1)
                return float(num) / float(den)
            return float(text)
        return text
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`key=value` strings -> dict, rejecting malformed items."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not key=value (e.g. sync_every=50)")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; flat keys, or tables whose keys are merged
    (e.g. [sync], [train])."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found: give an existing .toml file")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    return flat


def build_configs(
    values: dict[str, Any], sync: SyncConfig | None = None, train: TrainConfig | None = None
) -> tuple[SyncConfig, TrainConfig]:
    """Apply `values` (from TOML and key=value) over the given configs; unknown keys are errors."""
    known = config_fields()
    sync_kw: dict[str, Any] = {}
    train_kw: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            close = [k for k in known if k.startswith(key[:4])] if len(key) >= 4 else []
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown config key '{key}'{hint}: see `lowcomm train --help` for the keys"
            )
        cls, f = known[key]
        (sync_kw if cls is SyncConfig else train_kw)[key] = _coerce(key, f, raw)
    if "fragments" in sync_kw and "blocks_per_fragment" not in sync_kw:
        sync_kw["blocks_per_fragment"] = (
            0  # an explicit count replaces a preset's blocks per fragment
        )
    s = dataclasses.replace(sync or SyncConfig(), **sync_kw)
    t = dataclasses.replace(train or TrainConfig(), **train_kw)
    s.validate()
    validate_train(t)
    return s, t


def validate_train(t: TrainConfig) -> None:
    """Raise ConfigError for trainer settings that cannot work."""
    check_types(t)
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "threads",
        "eval_batches",
        "log_every",
        "ranks_per_worker",
    ):
        if getattr(t, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(t, name)}")
    for name in ("warmup_steps", "eval_every", "checkpoint_every"):
        if getattr(t, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(t, name)}")
    if t.batch_size % t.ranks_per_worker:
        raise ConfigError(
            f"batch_size={t.batch_size} does not split over ranks_per_worker="
            f"{t.ranks_per_worker}: give a multiple of {t.ranks_per_worker}"
        )
    if t.inner_lr <= 0:
        raise ConfigError(f"inner_lr must be > 0, got {t.inner_lr}")
    if t.timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {t.timeout_s}")
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {t.device}")
    if t.powersgd_rank < 1:
        raise ConfigError(f"powersgd_rank must be >= 1, got {t.powersgd_rank}")
    if t.powersgd_start < 2:
        raise ConfigError(
            f"powersgd_start must be >= 2 (PyTorch's PowerSGD needs two plain steps), "
            f"got {t.powersgd_start}"
        )


def help_text() -> str:
    """One line per config key, for `--help`."""
    lines = []
    for cls in (SyncConfig, TrainConfig):
        lines.append(f"{cls.__name__} keys:")
        for f in fields(cls):
            lines.append(f"  {f.name}={f.default!r}: {f.metadata.get('help', '')}")
    return "\n".join(lines)
