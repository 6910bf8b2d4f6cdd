"""The memory-traffic floor of a sync: the model-sized passes its algebra needs, per stage.

A *pass* is one read or one write of 4 bytes per synced element (an FP32 model-sized buffer).
The counts are what the math of docs/algorithms.md must touch at least, with no temporaries:

- encode: the pseudo-gradient (read the reference and the local weights, write the result: 3);
  error feedback ``e <- beta e + delta`` (3) and, with a dense codec, ``e -= sent`` (3; a sparse
  codec subtracts only the kept entries); LoCo's ``h = delta + e`` (3) and its moving average
  (read e, h and what was sent, write e: 4); the codec (read its input: 1, write the payload:
  its bytes per element / 4); a continue merge keeps what it sent (write: 1).
- decode_sum: an all-reduce of dense values sums in place (its division folds into the outer
  step's read: 0); a gathered codec reads every worker's payload and writes the mean (1).
- outer: Nesterov reads the global copy, the momentum and the mean, writes momentum and copy (5);
  plain SGD (or CO2 without momentum and clip) reads copy and mean, writes the copy (3); CO2's
  penalty reads and writes its two buffers (4 more).
- merge: replace reads the copy and writes the local weights (2); the alpha-mix reads both,
  writes the local weights (3); continue reads copy, own send, snapshot and local weights,
  writes local weights and snapshot (6).

Collectives are the network's and are not part of the floor. The floor in seconds is the passes
at the memory-copy bandwidth measured in the same run (a copy is a read and a write: 2 passes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowcomm.config import SyncConfig

if TYPE_CHECKING:
    from lowcomm.engine import LowComm

FLOOR_STAGES = ("encode", "decode_sum", "outer", "merge")


def _encode(cfg: SyncConfig, payload_bpe: float, sparse: bool) -> float:
    passes = 3.0 + 1.0 + payload_bpe / 4.0  # pseudo-gradient; codec input and payload
    if cfg.compensation == "ef":
        passes += 3.0 + (0.0 if sparse else 3.0)
    elif cfg.compensation == "loco":
        passes += 3.0 + 4.0
    return passes


def _outer(cfg: SyncConfig) -> float:
    if cfg.outer_optimizer == "nesterov":
        return 5.0 if cfg.outer_momentum > 0 else 3.0
    if cfg.outer_optimizer == "sgd":
        return 3.0
    momentum = cfg.outer_momentum > 0 or cfg.momentum_clip > 0
    return (5.0 if momentum else 3.0) + (4.0 if cfg.staleness_penalty else 0.0)


def floor_passes(
    cfg: SyncConfig,
    merge: str,
    dense_allreduce: bool,
    payload_bpe: float,
    workers: int,
    sparse: bool = False,
) -> dict[str, float]:
    """Model-sized passes per stage for one sync of every parameter once.

    ``merge``: replace, alpha or continue (the engine's merge rule); ``dense_allreduce``: the
    exchange sums dense values in place; ``payload_bpe``: payload bytes per element.
    """
    encode = _encode(cfg, payload_bpe, sparse) + (1.0 if merge == "continue" else 0.0)
    decode = 0.0 if dense_allreduce else workers * payload_bpe / 4.0 + 1.0
    merge_passes = {"replace": 2.0, "alpha": 3.0, "continue": 6.0}[merge]
    out = {"encode": encode, "decode_sum": decode, "outer": _outer(cfg), "merge": merge_passes}
    out["total"] = sum(out[s] for s in FLOOR_STAGES)
    return out


def engine_floor(engine: LowComm, workers: int) -> dict[str, float]:
    """:func:`floor_passes` for a built engine: its merge rule, exchange and payload size."""
    from lowcomm.engine.sync import AlphaMix, Continue

    rule = engine.parts.apply.merge
    merge = (
        "continue"
        if isinstance(rule, Continue)
        else "alpha"
        if isinstance(rule, AlphaMix)
        else "replace"
    )
    agg = engine.aggregator
    shapes = [p.shape for p in engine._by_name.values()]
    numel = sum(p.numel() for p in engine._by_name.values())
    payload_bpe = (agg.payload_nbytes(shapes) - 1) / numel
    dense = agg.method == "allreduce"
    sparse = hasattr(agg.codec, "decode_sparse")
    return floor_passes(engine.config, merge, dense, payload_bpe, workers, sparse)
