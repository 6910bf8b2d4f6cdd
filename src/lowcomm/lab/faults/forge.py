"""The attacks that need what the other sites sent (``copy:SITE``, ``alie:SITE``), acted out on
the gather exchange's payload: on gather every site receives every contribution, so a bad site
holds the last round's and can forge its next from them.

- ``copy`` (a free-rider): it sends, as its own, the last payload of the first other site that
  sent a valid one, byte for byte; it trains, but its work never reaches the others.
- ``alie`` ("a little is enough", Baruch et al., 2019): the colluding bad sites all send
  ``mean - z * std`` of the honest sites' contributions of the last round, coordinate by
  coordinate, with ``z`` the largest that keeps the forged value inside the spread a majority
  can hide in: with n sites and m bad, s = floor(n/2 + 1) - m and z = Phi^-1((n - s) / n).
  The standard omniscient attacker: it is assumed to see the honest contributions (here it
  does, one round late) and to know who its fellows are.

In a fixed world a site's group rank is its number, which is how the colluders tell their own
rows from the honest ones; the first round, with nothing seen yet, every bad site sends honestly.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

PAYLOAD_ATTACKS = ("copy", "alie")


def forge(
    payload: torch.Tensor,
    shapes: list[torch.Size],
    rank: int,
    agg: Any,
    last: list[torch.Tensor] | None,
    kind: str,
    colluders: list[int],
) -> torch.Tensor:
    """The payload a bad site (group rank ``rank``) acting out ``kind`` sends in place of its
    own ``payload``, from ``last``, what every site sent last round of this group (None:
    nothing seen yet); ``agg``: the gather aggregator, which decodes and encodes for it;
    ``colluders``: the sites of every ``alie`` attack."""
    if last is None or not int(payload[-1]):  # nothing seen yet, or nothing to contribute
        return payload
    valid = [r for r, p in enumerate(last) if int(p[-1]) == 1]
    if kind == "copy":
        victim = next((r for r in valid if r != rank), None)
        return payload if victim is None else last[victim].clone()
    bad = set(colluders)
    honest = [r for r in valid if r not in bad]
    if not honest:
        return payload
    plan = agg.codec.plan(shapes, payload.device)  # one bucket's tensors, its flag after
    rows = torch.stack([_dense(plan, last[r]) for r in honest])
    spread = rows.std(dim=0) if len(honest) > 1 else torch.zeros_like(rows[0])
    forged = rows.mean(dim=0) - alie_z(len(last), len(bad)) * spread
    out = torch.empty(plan.span + 1, dtype=torch.uint8, device=payload.device)
    plan.encode(forged, out)
    out[-1] = payload[-1]  # its own flag: it sends
    return out


def _dense(plan: Any, payload: torch.Tensor) -> torch.Tensor:
    """What a bucket's payload decodes to, as one flat FP32 tensor (zeros where a sparse
    codec sent nothing)."""
    idx, values, _ = plan.decode(payload)
    if idx is None:
        return values
    return torch.zeros(plan.numel, device=values.device).index_copy_(0, idx, values)


def alie_z(n: int, m: int) -> float:
    """Baruch et al.'s z for ``m`` colluders among ``n`` sites (0 when they cannot hide)."""
    s = n // 2 + 1 - m
    q = (n - s) / n
    return statistics.NormalDist().inv_cdf(q) if 0 < q < 1 else 0.0
