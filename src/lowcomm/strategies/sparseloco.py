"""SparseLoCo: top-k 2-bit pseudo-gradients with error feedback, plain SGD outer step."""

from __future__ import annotations

from .base import Strategy, register


@register
class SparseLoCo(Strategy):
    """Sarfi et al. 2025: density 1/64, 2-bit values, error feedback, outer SGD at lr 1."""

    name = "sparseloco"
    summary = "top-k 2-bit pseudo-gradients with error feedback, plain SGD outer step"
    # selected-mean: measured better than the 1/M mean (benchmarks/sparseloco.md: 1.4814 vs
    # 1.6458); aggregation=auto picks it for top-k
    settings = {
        "sync_every": 15,
        "codec": "topk",
        "density": 1 / 64,
        "value_bits": 2,
        "reduce": "gather",
        "compensation": "ef",
        "error_decay": 0.95,
        "merge": "continue",
        "outer_optimizer": "sgd",
        "outer_lr": 1.0,
    }
    sends_selection = True
