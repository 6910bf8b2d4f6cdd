"""Load a trained model back from a run folder: ``lowcomm.load_model(DIR)``."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ..errors import ConfigError
from .build import build_model
from .summary import RunSummary


def load_model(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The model a run trained: rebuilt from DIR/summary.json, weights from DIR/model.pt.

    ``path`` is a run folder (``lowcomm train --out DIR``) or its ``model.pt``. Returns the
    model in eval mode on ``device``; calling it as ``model(tokens, targets)`` gives the loss.
    """
    p = Path(path)
    run_dir, weights = (p, p / "model.pt") if p.is_dir() else (p.parent, p)
    for need in (weights, run_dir / "summary.json"):
        if not need.is_file():
            raise ConfigError(
                f"{need} not found: give a finished run folder (lowcomm train --out "
                f"DIR) or its model.pt"
            )
    summary = RunSummary.read(run_dir)
    preset, seq_len = summary.config.get("model"), summary.config.get("seq_len")
    if not preset or not seq_len:
        raise ConfigError(
            f"{run_dir / 'summary.json'} has no model or seq_len in its config: "
            f"it was not written by lowcomm train"
        )
    state = torch.load(weights, map_location="cpu", weights_only=True)
    # runs written before summaries recorded vocab_size: the embedding table's rows
    vocab = summary.vocab_size or _vocab_from_state(state)
    model = build_model(preset, vocab_size=vocab, max_seq_len=seq_len)
    model.load_state_dict(state)
    return model.to(device).eval()


def _vocab_from_state(state: dict[str, torch.Tensor]) -> int:
    emb = [v for k, v in state.items() if k.endswith("embed.weight") and v.dim() == 2]
    if not emb:
        raise ConfigError(
            "cannot tell the vocabulary size: summary.json has no vocab_size and "
            "model.pt no embed.weight"
        )
    return int(emb[0].shape[0])
