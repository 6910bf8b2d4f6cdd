"""A small Llama-style decoder in one file: RMSNorm, rotary positions, SwiGLU, causal attention.

Layout matters to the engine: `embed`, `norm` and `head` are separate submodules so Streaming
DiLoCo can group them into one fragment, and each entry of `blocks` is a fragment candidate.
Input embedding and output head are untied, so every parameter belongs to exactly one fragment.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "PRESETS", "Decoder", "Block", "build_model", "count_params"]


@dataclass
class ModelConfig:
    """Shape of a `Decoder`; every field is a CLI/TOML knob under the same name."""

    vocab_size: int = 256
    """Number of token ids; 256 means raw bytes (the default corpora are byte-tokenised)."""
    dim: int = 128
    """Width of the residual stream (embedding size)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; `dim` must be divisible by it."""
    ffn_hidden: int | None = None
    """Hidden width of the SwiGLU MLP; None uses Llama's rule, 8/3*dim rounded up to a
    multiple of 32."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (rotary angles are computed on the fly, so this is
    a check)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm's square root."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(
                f"head dim {self.dim // self.n_heads} must be even for rotary positions"
            )

    @property
    def hidden(self) -> int:
        """The SwiGLU hidden width actually used."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        # 8/3*dim keeps SwiGLU's three matrices at the parameter count of a 4*dim GELU MLP.
        return 32 * math.ceil(8 * self.dim / 3 / 32)


PRESETS: dict[str, ModelConfig] = {
    # Tests: a training step of batch 4 x seq 32 takes a few milliseconds on one CPU thread.
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=128),
    # About 0.87M parameters: the demo model.
    "small": ModelConfig(dim=128, n_layers=4, n_heads=4, max_seq_len=256),
    # About 10.1M parameters: CPU benchmarks. Eight blocks split evenly into 2, 4 or 8 fragments.
    "base": ModelConfig(dim=320, n_layers=8, n_heads=5, max_seq_len=512),
    # GPT-2-small shape (dim 768, 12 layers, 12 heads), named by its size with byte tokens:
    # ~85.4M parameters (GPT-2's 124M counts a 50257-token embedding tied to its head; with
    # vocab_size=50257, untied as here, it has ~162.1M).
    # Called `124m` until 2026-11-26: see RENAMED.
    "85m": ModelConfig(dim=768, n_layers=12, n_heads=12, max_seq_len=1024),
}
# Presets that were renamed: the old name gets a one-line error naming the new one.
RENAMED: dict[str, str] = {"124m": "85m"}


def unknown_preset(name: str) -> str:
    """The one-line error for a model name that is not a preset (a renamed one says so)."""
    if name in RENAMED:
        return (
            f"model preset '{name}' is now '{RENAMED[name]}' (named by its real size with "
            f"byte tokens): use --model {RENAMED[name]}"
        )
    return f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}"


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain and no bias (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension in FP32, then scale."""
        # FP32 for the mean of squares: in bf16 it loses the precision the norm exists to provide.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_angles(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of the rotary angles, each [seq_len, head_dim // 2], in FP32."""
    # Computed per call rather than cached in a buffer: it is cheap, stays FP32 when the model is
    # cast to bf16, and keeps state_dict() equal to the parameters.
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [B, H, T, D] by the position's angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        # One fused projection: a single matmul is faster than three small ones, on CPU especially.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend each position to itself and earlier positions."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gated feed-forward on each position independently."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply attention then the MLP, each as a residual update."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Decoder-only language model: embed -> blocks -> norm -> head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections shrunk by 1/sqrt(2 * n_layers)."""
        # Each block adds two residual updates; shrinking their projections keeps the residual
        # stream's variance from growing with depth at init.
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        # Module order is fixed, so the same torch.manual_seed gives the same weights.
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith("attn.proj") or name.endswith("mlp.down")
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else 0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] if targets is None, else the mean cross-entropy
        (targets of -1 ignored)."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = rotary_angles(
            T, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta, tokens.device
        )
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        # FP32 for the softmax: bf16 logits make the loss noticeably noisy.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


def build_model(preset: str | ModelConfig, **overrides: object) -> nn.Module:
    """Build a Decoder from a preset name or config, with field overrides (e.g. vocab_size=50257).

    ``hf:`` models are built by :func:`lowcomm.train.build.build_model`, which also takes these.
    """
    if isinstance(preset, ModelConfig):
        cfg = preset
    elif preset in PRESETS:
        cfg = PRESETS[preset]
    else:
        raise ValueError(unknown_preset(preset))
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(
            f"unknown ModelConfig fields {sorted(unknown)}; "
            f"valid: {[f.name for f in dataclasses.fields(ModelConfig)]}"
        )
    # replace() re-runs __post_init__, so bad overrides fail here, and presets are never mutated.
    return Decoder(dataclasses.replace(cfg, **overrides))


def count_params(model: nn.Module) -> int:
    """Number of parameters (elements), counting each shared tensor once."""
    return sum(p.numel() for p in model.parameters())
