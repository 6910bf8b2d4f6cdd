"""Hugging Face ``transformers`` causal LMs in lowcomm: models for the trainer, and HF's Trainer.

Models. ``model=hf:ARCH[:PRESET]`` builds a causal LM of architecture ARCH (``llama``, ``gpt2``,
``qwen2``, ... any ``AutoConfig`` model type) from a config at one of our size presets (same
width, depth and heads as the built-in decoder's ``tiny``/``small``/``base``/``85m``; no
download). ``model=hf:PATH`` loads a local folder: a checkpoint (``config.json`` + weights) or a
config alone (fresh weights). :class:`HFCausalLM` adapts it to our trainer's ``model(x, y) ->
loss`` call; its parameter names are the HF model's own, so ``model.pt`` is an HF state dict.

HF Trainer. ``Trainer`` hands the model to Accelerate (``Trainer._prepare_for_training`` calls
``accelerator.prepare(model, optimizer)``), and ``Accelerator.prepare_model`` wraps it in
``DistributedDataParallel`` whenever more than one process is running (``not evaluation_mode and
self.multi_device``). That happens before any callback runs, so a callback alone would all-reduce
gradients every step: DiLoCo silently turned into DDP. :class:`LowCommTrainer` therefore replaces
its accelerator's ``prepare_model`` by one that always passes ``evaluation_mode=True``: device
placement and mixed precision still apply, the DDP wrap does not. Everything else of Accelerate's
multi-process mode stays on: each worker's data loader yields its own shard, metrics are
gathered, only the main process saves. The trainer wraps the optimizer it creates in the lowcomm
engine (which hooks ``optimizer.step()``), starts the engine at train begin and finishes it at
train end, so the model then holds the global parameters. :class:`LowCommCallback` does the
engine part for a Trainer of your own that keeps data parallelism off; at the first step it
stops a run whose gradients are identical on every worker (all-reduced: DDP). See docs/hf.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import split_sync_kwargs
from .errors import ConfigError
from .transport import Transport

if TYPE_CHECKING:  # the engine is imported when one is made (lowcomm.hf stays light)
    from .engine import LowComm

try:  # an optional extra: pip install 'lowcomm[hf]'
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        PretrainedConfig,
        PreTrainedModel,
        Trainer,
        TrainerCallback,
    )
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lowcomm.hf needs Hugging Face transformers: pip install 'lowcomm[hf]'"
    ) from err

__all__ = [
    "HFCausalLM",
    "HFShape",
    "hf_config",
    "parse_spec",
    "load_hf_model",
    "build_hf_model",
    "make_engine",
    "LowCommCallback",
    "LowCommTrainer",
]


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM as a lowcomm model: ``forward(x, y)`` returns the mean loss.

    The HF model's children and direct parameters are registered here under their own names (not
    under a prefix), so parameter names, ``state_dict()`` keys and the block list the engine finds
    are exactly the HF model's. The HF model itself is :attr:`hf_model`.
    """

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__()
        # Kept out of nn.Module's registries: registering it too would prefix every name.
        self.__dict__["_hf"] = hf_model
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        for name, param in hf_model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in hf_model.named_buffers(recurse=False):
            self.register_buffer(name, buf)

    @property
    def hf_model(self) -> PreTrainedModel:
        """The wrapped ``transformers`` model (shares every tensor with this module)."""
        return self.__dict__["_hf"]

    def train(self, mode: bool = True) -> HFCausalLM:
        """Set training mode here and on the HF model (whose own flag some forwards read)."""
        self.hf_model.train(mode)
        return super().train(mode)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] if targets is None, else the mean cross-entropy (-1 ignored).

        ``targets`` are already shifted (targets[:, t] follows tokens[:, t]), as our batches are.
        """
        logits = self.hf_model(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)

    def save_pretrained(
        self,
        path: str | Path,
        tokenizer_file: str | None = None,
        state_dict: dict[str, Any] | None = None,
    ) -> None:
        """Write the HF model to ``path`` so ``AutoModelForCausalLM.from_pretrained`` reloads it;
        with the run's ``tokenizers`` file, ``AutoTokenizer.from_pretrained`` too.
        ``state_dict`` (this wrapper's keys) replaces the model's own, e.g. gathered shards."""
        from transformers.utils import logging as hf_logging

        # no "Writing model shards" bar: it is noise in a run's log
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            kw = {}
            if state_dict is not None:
                kw["state_dict"] = {k.removeprefix("hf_model."): v for k, v in state_dict.items()}
            self.hf_model.save_pretrained(str(path), **kw)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
        if tokenizer_file is not None:
            from transformers import PreTrainedTokenizerFast

            PreTrainedTokenizerFast(tokenizer_file=tokenizer_file).save_pretrained(str(path))


@dataclass(frozen=True)
class HFShape:
    """The size of a model built from a config, as plain numbers (the caller picks them: the
    trainer resolves ``hf:ARCH:PRESET`` from its decoder's presets)."""

    dim: int
    """Width of the residual stream (``hidden_size``)."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention heads (also the key/value heads: plain multi-head attention)."""
    hidden: int
    """MLP width (``intermediate_size``), where the architecture has one."""
    max_seq_len: int
    """Positions, unless the caller asks for another ``max_seq_len``."""


def hf_config(
    arch: str, shape: HFShape, vocab_size: int = 256, max_seq_len: int | None = None
) -> PretrainedConfig:
    """An HF config of model type ``arch`` at ``shape`` (width, depth, heads, MLP width)."""
    kw: dict[str, Any] = dict(
        hidden_size=shape.dim,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_seq_len or shape.max_seq_len,
    )
    if arch not in CONFIG_MAPPING:
        raise ConfigError(
            f"unknown Hugging Face model type '{arch}' in model=hf:{arch}: use a "
            f"transformers model type (llama, gpt2, qwen2, ...) or a local folder"
        )
    config_cls = CONFIG_MAPPING[arch]
    # Default special ids (GPT-2's 50256) may lie outside a small vocabulary; we never use them.
    defaults = config_cls()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(defaults, key, None)
        if isinstance(value, int) and value >= vocab_size:
            kw[key] = None
    cfg = config_cls(**kw)
    if hasattr(cfg, "intermediate_size"):
        cfg.intermediate_size = shape.hidden  # SwiGLU width, as in our decoder
    if hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = shape.n_heads  # plain multi-head attention
    # no dropout, as in our decoder: runs are short, and losses stay comparable and reproducible
    for key, value in cfg.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(cfg, key, 0.0)
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = shape.dim // shape.n_heads
    return cfg


def _from_folder(path: Path, vocab_size: int | None, max_seq_len: int | None) -> PreTrainedModel:
    """A checkpoint folder's model, or fresh weights for a folder that holds only a config."""
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if weights:
        model = AutoModelForCausalLM.from_pretrained(str(path))
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    have = model.get_input_embeddings().weight.shape[0]
    if vocab_size is not None and vocab_size > have:
        raise ConfigError(
            f"the corpus needs {vocab_size} token ids but model {path} has {have}: "
            f"use a tokenizer with at most {have} tokens or a larger model"
        )
    positions = getattr(model.config, "max_position_embeddings", None)
    if max_seq_len is not None and positions is not None and max_seq_len > positions:
        raise ConfigError(
            f"seq_len={max_seq_len} exceeds model {path}'s {positions} positions: "
            f"use seq_len={positions} or less"
        )
    return model


def parse_spec(spec: str) -> Path | tuple[str, str]:
    """What follows ``hf:``: a model folder, or ``(ARCH, PRESET)`` (PRESET ``tiny`` if not given).

    The preset is a name only: the caller turns it into an :class:`HFShape`.
    """
    if not spec:
        raise ConfigError(
            "empty model=hf: name: use hf:ARCH[:PRESET] (e.g. hf:llama:tiny) or hf:PATH"
        )
    path = Path(spec)
    looks_like_path = "/" in spec or spec.startswith(".")
    # a bare name (hf:llama) is a model type unless it is a model folder here
    if path.is_dir() and (looks_like_path or (path / "config.json").exists()):
        if not (path / "config.json").exists():
            raise ConfigError(
                f"model folder {path} has no config.json: give a folder written by "
                f"save_pretrained, or hf:ARCH[:PRESET]"
            )
        return path
    if looks_like_path:
        raise ConfigError(
            f"model folder {spec} does not exist: give an existing folder or "
            f"hf:ARCH[:PRESET] (models are built from configs, never downloaded)"
        )
    arch, _, preset = spec.partition(":")
    return arch, preset or "tiny"


def load_hf_model(
    path: Path, vocab_size: int | None = None, max_seq_len: int | None = None
) -> HFCausalLM:
    """The model of a folder from :func:`parse_spec` (a checkpoint, or a config alone)."""
    return HFCausalLM(_from_folder(path, vocab_size, max_seq_len))


def build_hf_model(
    arch: str, shape: HFShape, vocab_size: int = 256, max_seq_len: int | None = None
) -> HFCausalLM:
    """A fresh model of type ``arch`` at ``shape`` (no download)."""
    cfg = hf_config(arch, shape, vocab_size, max_seq_len)
    return HFCausalLM(AutoModelForCausalLM.from_config(cfg))


def make_engine(
    model: nn.Module, optimizer: torch.optim.Optimizer, strategy: str = "diloco", **kwargs: Any
) -> LowComm:
    """The lowcomm engine of a named strategy (diloco, streaming, sparseloco, co2) on ``model``.

    ``kwargs`` are SyncConfig knobs (``sync_every=50``) or LowComm options (``timeout_s``).
    """
    from . import strategies
    from .engine import LowComm

    method = strategies.get(strategy)
    if method.per_step:
        raise ConfigError(
            f"strategy '{strategy}' is per-step gradient reduction: with the HF "
            f"Trainer use plain DDP (transformers.Trainer) instead of lowcomm"
        )
    sync_kw, other = split_sync_kwargs(kwargs)
    return LowComm(model, optimizer, method.config(**sync_kw), **other)


def _is_ddp(model: Any) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's AcceleratedOptimizer (whose step() calls it)."""
    return getattr(optimizer, "optimizer", optimizer)


def _grads_identical_everywhere(model: nn.Module) -> bool:
    """True when every worker holds bit-identical gradients: only an all-reduce makes them so."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    grads = [p.grad.detach().double() for p in model.parameters() if p.grad is not None]
    probe = torch.zeros(2, dtype=torch.float64)
    for g in grads:
        probe[0] += g.sum().cpu()
        probe[1] += g.pow(2).sum().cpu()
    everyone = Transport().all_gather(probe, control=True)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


class LowCommCallback(TrainerCallback):
    """Runs a lowcomm engine around an HF Trainer's training: started at train begin (it hooks
    the optimizer's ``step()``), finished at train end (the model then holds the global parameters).

    Use it only in a Trainer that keeps data parallelism off (as :class:`LowCommTrainer` does): at
    the first optimizer step it checks, with one tiny all-gather, that the workers' gradients
    differ, and stops the run with a ``ConfigError`` if they are identical (a DDP wrap).
    """

    def __init__(self, strategy: str = "diloco", **kwargs: Any) -> None:
        self.strategy = strategy
        self.kwargs = kwargs
        self.engine: LowComm | None = None
        self.active = False
        self._checked = False

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Build the engine on the Trainer's model and optimizer and start it."""
        if model is None or optimizer is None:
            raise ConfigError(
                "LowCommCallback needs the Trainer's model and optimizer: add it "
                "to a transformers.Trainer (or use lowcomm.hf.LowCommTrainer)"
            )
        if _is_ddp(model):
            raise ConfigError(
                "the model is wrapped in DistributedDataParallel, which all-reduces "
                "gradients every step: use lowcomm.hf.LowCommTrainer"
            )
        # a fresh engine per train() call: the optimizer may be a new one
        self.engine = make_engine(model, _unwrap_optimizer(optimizer), self.strategy, **self.kwargs)
        self.engine.start()
        self.active, self._checked = True, False

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        """Once per run: refuse gradients that were all-reduced (DiLoCo silently become DDP)."""
        if self._checked or model is None:
            return
        self._checked = True
        if _grads_identical_everywhere(model):
            raise ConfigError(
                "gradients are identical on every worker after the first step: the "
                "Trainer all-reduces them (DDP) or every worker reads the same data; "
                "use lowcomm.hf.LowCommTrainer, which keeps DDP off and shards data"
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Apply what is in flight and load the global parameters into the model."""
        if self.engine is not None and self.active:
            self.engine.finish()
        self.active = False


def _prepare_model_without_ddp(prepare_model: Any) -> Any:
    """Accelerator.prepare_model with DDP (and FSDP/TP) wrapping skipped: evaluation_mode=True
    keeps device placement, mixed precision and torch.compile."""

    def prepare(
        model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    return prepare


class LowCommTrainer(Trainer):
    """``transformers.Trainer`` for low-communication training: no DDP, one lowcomm engine.

    ``LowCommTrainer(model, args, train_dataset=..., lowcomm_strategy="diloco",
    lowcomm_kwargs={"sync_every": 50})``; ``lowcomm_kwargs`` are SyncConfig knobs. Each worker
    trains on its own shard of the data (Accelerate's sharded loaders) and the workers exchange
    only the engine's outer syncs. ``evaluate()`` during training uses the global parameters.
    """

    def __init__(
        self,
        *args: Any,
        lowcomm_strategy: str = "diloco",
        lowcomm_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.lowcomm_callback = LowCommCallback(lowcomm_strategy, **(lowcomm_kwargs or {}))
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ConfigError(
                "LowCommTrainer trains a full model replica per worker: turn off "
                "FSDP / DeepSpeed (fsdp=, deepspeed= in TrainingArguments)"
            )
        if self.args.fp16:
            # the engine counts optimizer steps; a step skipped on one worker shifts its syncs
            raise ConfigError(
                "fp16 loss scaling skips optimizer steps on overflow, worker by "
                "worker, which desynchronizes the syncs: use bf16=True instead"
            )
        self.add_callback(self.lowcomm_callback)
        # Scaling each loss by the token count of all workers assumes DDP averages gradients.
        if getattr(self.args, "average_tokens_across_devices", False):
            self.args.average_tokens_across_devices = False

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator, with its model preparation never wrapping in DDP."""
        super().create_accelerator_and_postprocess()
        self.accelerator.prepare_model = _prepare_model_without_ddp(self.accelerator.prepare_model)

    @property
    def lowcomm(self) -> LowComm | None:
        """The engine of the current (or last) training run, or None before the first."""
        return self.lowcomm_callback.engine

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer.evaluate on the global parameters while training, as each worker's differ."""
        cb = self.lowcomm_callback
        ctx = cb.engine.global_parameters() if cb.active else contextlib.nullcontext()
        with ctx:
            return super().evaluate(*args, **kwargs)
