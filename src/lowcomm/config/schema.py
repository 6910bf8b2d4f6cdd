"""The config's schema: every knob of docs/algorithms.md's table as a dataclass field, one name
per knob, with its help text.

Each field carries its help text in ``metadata["help"]``; the CLI's ``--help`` and the
``key=value`` override parser read it from there, so docs and code cannot drift apart. The
checks live in :mod:`lowcomm.config.checks` (run from ``__post_init__``), the parsing of TOML and
``key=value`` in :mod:`lowcomm.config.parse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from . import checks
from .choices import (
    CODECS,
    DENSE_CODECS,
    SPARSE_CODECS,
    SUM_RULES,
    Aggregation,
    Buffers,
    ClipMode,
    CO2Merge,
    Codec,
    Compensation,
    DdpHook,
    FragmentPattern,
    InnerParallel,
    Kernels,
    LocoQuantizer,
    LogTo,
    Merge,
    OuterKind,
    Reduce,
    Shard,
    StateDevice,
)


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
    codec: Codec = knob("fp32", f"What goes on the wire: {'|'.join(CODECS)}.")
    codec_block: int = knob(128, "Elements per scale block for the int-k and fp4 codecs.")
    density: float = knob(
        1 / 64, "Top-k codec: fraction of entries kept per chunk (1/64 = 64 of 4096)."
    )
    value_bits: int = knob(
        2,
        "Top-k codec: bits per kept value (2 = 4-entry lookup of bin means; 32 = the values "
        "as FP32).",
    )
    reduce: Reduce = knob(
        "auto",
        "Collective for the outer gradient: allreduce (dense codecs), gather "
        "(all-gather + FP32 sum), two-phase (all-to-all reduce-scatter + "
        "all-gather), or auto (allreduce for fp32/bf16/fp16, gather otherwise).",
    )
    aggregation: Aggregation = knob(
        "auto",
        "How the contributions are combined: mean (1/M sum of decoded payloads), "
        "selected-mean (top-k: each entry averaged over the workers that sent it, as the "
        "SparseLoCo authors' code does; measured better), auto (selected-mean for "
        "codec=topk, mean otherwise), or a robust rule against bad sites (reduce=gather): "
        "norm-clip (each clipped to the median norm; top-k too), cosine-clip (norm-clip "
        "that also drops a contribution against the others; top-k too), share-clip "
        "(cosine-clip whose top-k merge counts an entry few sent as their share of a "
        "majority), median, "
        "trimmed-mean, centered-clip (dense codecs).",
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
    update_bound: float = knob(
        0.0,
        "Check before apply: skip, on every site alike, an outer step whose combined update "
        "is not finite or above this many times the median norm of the fragment's last 16 "
        "updates (after 3); 0 = off. A robust aggregation bounds bad sites first.",
    )
    offender_syncs: int = knob(
        3,
        "With a robust aggregation: name a site (a warning, and stats) whose contribution "
        "is not finite, mostly left out by the rule (unreadable, empty, or against the "
        "others) or above 4x the sync's median norm in this many syncs in a row among the "
        "same sites, from 3 sites on (0 = never).",
    )
    evict: bool = knob(
        False,
        "Elastic, with offender_syncs: a named site is also excluded from the run, by every "
        "site alike (membership.jsonl records it; started again, it may come back).",
    )
    replica_check_every: int = knob(
        10,
        "Every N syncs, compare a checksum of the global parameters across workers; a "
        "mismatch stops the run (0 = never). Elastic sites of one rank vote: those outside a "
        "majority's copy leave and the others go on (no majority: the run stops).",
    )
    state_device: StateDevice = knob(
        "model",
        "Where every sync buffer lives (global copy, outer state, error buffers, the "
        "pseudo-gradient): the model's device (model), or cpu to save accelerator memory "
        "at the price of crossing to the host at every sync.",
    )
    bucket_mb: float = knob(64.0, "Largest flat buffer handed to one collective, in MiB.")
    kernels: Kernels = knob(
        "auto",
        "Which implementations a sync's kernels run: auto (Triton's on CUDA where it is "
        "installed, C's on the CPU where a compiler is) or torch (the reference ones, on "
        "every device: the same bits, slower).",
    )
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
        checks.validate_sync(self)
        return self

    @property
    def resolved_reduce(self) -> str:
        """``reduce`` with auto resolved: allreduce for dense codecs combined by a sum (the
        mean), gather otherwise (a robust rule needs every contribution)."""
        if self.reduce != "auto":
            return self.reduce
        summed = self.resolved_aggregation in SUM_RULES
        return "allreduce" if self.codec in DENSE_CODECS and summed else "gather"

    @property
    def resolved_aggregation(self) -> str:
        """``aggregation`` with auto resolved: selected-mean for top-k payloads, mean otherwise."""
        if self.aggregation != "auto":
            return self.aggregation
        return "selected-mean" if self.codec in SPARSE_CODECS else "mean"

    @property
    def tau(self) -> int:
        """The overlap in inner steps, with -1 resolved to a whole round (H)."""
        return self.sync_every if self.overlap == -1 else self.overlap

    def check_schedule(self, n_fragments: int) -> None:
        """The schedule's overlap rule for ``n_fragments`` resolved fragments (ConfigError)."""
        from ..schedule import Schedule  # the rule lives with the schedule it protects

        Schedule(self.sync_every, n_fragments, self.tau)


@dataclass
class TrainConfig:
    """The reference trainer's knobs (model, data, inner optimizer, logging, run control)."""

    def __post_init__(self) -> None:
        checks.validate_train(self)

    model: str = knob(
        "small",
        "Model preset: tiny, small, base or 85m; or a Hugging Face causal LM: "
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
