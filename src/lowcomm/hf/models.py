"""Hugging Face causal LMs as lowcomm models, built from configs (no download).

``model=hf:ARCH[:PRESET]`` builds a causal LM of architecture ARCH (``llama``, ``gpt2``,
``qwen2``, ... any ``AutoConfig`` model type) from a config at one of our size presets (same
width, depth and heads as the built-in decoder's ``tiny``/``small``/``base``/``85m``).
``model=hf:PATH`` loads a local folder: a checkpoint (``config.json`` + weights) or a config
alone (fresh weights). :class:`HFCausalLM` adapts it to our trainer's ``model(x, y) -> loss``
call; its parameter names are the HF model's own, so ``model.pt`` is an HF state dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..errors import ConfigError


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
