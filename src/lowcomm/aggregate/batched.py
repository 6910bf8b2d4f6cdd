"""The gather exchange over a whole bucket at once, where the codec has a plan for it (top-k:
:mod:`~lowcomm.codecs.topk_many`; the block codecs: :mod:`~lowcomm.codecs.block_many`): one
encode, one decode per sender and one combine over the
bucket's flat coordinates, in kernel launches that do not grow with the number of tensors, and
one host synchronisation per exchange (every sender's flag and decode check, read together).

The same bytes on the wire as the per-tensor path (the table's statistics up to their last
bit, see topk_many) and the same bits out of the mean and the selected mean. Anything else
(another rule, per-sender norms, a weighted merge that needs what it left unapplied, a payload
that breaks a rule) goes the per-tensor way, which also names a faulty sender.

Used on accelerators; ``LOWCOMM_BATCH=1`` turns it on on the CPU too (tests), ``0`` off.
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs.topk_many import wanted
from .base import NONFINITE, SENT, Encoded, Reduced, Valid, flag_of, flags_allowed
from .combine import Combine
from .rules.mean import Mean, _divisor
from .rules.selected_mean import SelectedMean, selected_mean


def plan_for(codec: Any, shapes: list[torch.Size], device: torch.device) -> Any:
    """The codec's plan for ``shapes`` on ``device`` where the bucket goes at once, else None."""
    if not wanted(device):
        return None
    plan = getattr(codec, "plan", None)
    return plan(shapes, device) if plan is not None else None


def encode(
    plan: Any,
    tensors: list[torch.Tensor],
    valid: Valid,
    flat: torch.Tensor | None,
    want: str,
    key: str | None,
) -> Encoded:
    """The bucket's payload (flag last); ``want``: "" nothing of our own decode, "sparse" it as
    (flat indices, values), "dense" as one flat FP32 tensor. ``flat``: the tensors one after
    another, if the caller has them so (else they are concatenated). ``valid`` on the device:
    the payload encodes ``flat`` as it is and goes out flagged by it (peers read the flag
    before anything else, and drop a NONFINITE sender's bytes unread)."""
    shapes = [t.shape for t in tensors]
    n = sum(s.numel() for s in shapes)
    dev = tensors[0].device
    if valid is False:
        flat = torch.zeros(n, device=dev)
    elif flat is None:
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    payload = torch.empty(plan.nbytes + 1, dtype=torch.uint8, device=dev)
    idx, values = plan.encode(flat, payload)
    payload[-1] = flag_of(valid)  # after the packing, which used it as scratch
    ok = valid if isinstance(valid, torch.Tensor) else None
    if not plan.sparse:  # a dense codec: our decode is what peers decode of the payload
        local = plan.decode(payload[:-1])[1] if want else None
        return Encoded(payload, shapes, n, local, key, ok=ok)
    if want == "sparse":
        return Encoded(payload, shapes, n, None, key, sparse_flat=(idx, values), ok=ok)
    local = None
    if want == "dense":
        local = torch.zeros(n, device=dev).index_copy_(0, idx, values)
    return Encoded(payload, shapes, n, local, key, ok=ok)


def combines(plan: Any, rule: Combine, weights: list[float] | None, me: int | None) -> bool:
    """Whether the bucket-at-once combine computes what ``rule`` would (the plain rules, with
    nothing per tensor asked of them; the selected mean of a sparse codec's)."""
    rules = (Mean, SelectedMean) if plan.sparse else (Mean,)
    return type(rule) in rules and (weights is None or me is None)


def combine(
    plan: Any,
    rule: Combine,
    gathered: list[torch.Tensor],
    numel: int,
    weights: list[float] | None,
    out: torch.Tensor | None,
    track: bool = False,
    me: int = -1,
    deferred_checks: bool = False,
) -> Reduced | None:
    """The rule's combination of every valid sender's bucket, or None where a sender's flag
    or payload is bad (the per-tensor path then raises, naming it). ``track``: with each
    sender's squared norm (FP64, of the values it sent; inf where not finite). ``me``: this
    worker's group rank, told whether its own payload was flagged NONFINITE (a flag allowed
    only with ``deferred_checks``)."""
    decoded = [plan.decode(g[:-1]) for g in gathered]
    flags = torch.stack([g[-1].to(torch.float64) for g in gathered])
    bad = torch.stack([d[2] for d in decoded]).to(torch.float64)
    norms = [d[1].double().square().sum() for d in decoded] if track else []
    read = torch.cat([flags, bad, *[n.view(1) for n in norms]]).tolist()  # the one host read
    m = len(gathered)
    flag, broken = read[:m], read[m : 2 * m]
    allowed = flags_allowed(deferred_checks)
    if any(f not in allowed or (f == SENT and b) for f, b in zip(flag, broken)):
        return None
    senders = [w for w, f in enumerate(flag) if f == SENT]
    told = {
        "nonfinite": tuple(w for w, f in enumerate(flag) if f == NONFINITE),
        "left_out_here": 0 <= me < m and flag[me] == NONFINITE,
    }
    tracked = {w: inf_if_nan(read[2 * m + w]) for w in senders} if track else None
    dev = gathered[0].device
    total = out if out is not None else torch.empty(numel, device=dev)
    if not senders:
        return Reduced(total.zero_(), 0, **told)
    sent = [(decoded[w][0], decoded[w][1]) for w in senders]
    ws = [weights[w] for w in senders] if weights is not None else None
    if isinstance(rule, SelectedMean):
        return Reduced(selected_mean(sent, ws, total), len(senders), None, tracked, **told)
    total.zero_()
    for j, (idx, values) in enumerate(sent):
        part = values * ws[j] if ws is not None else values
        if idx is None:  # a dense codec's: the per-tensor rule's sum, element by element
            total += part
        else:
            total.index_add_(0, idx, part)
    mean = total.div_(_divisor(sum(ws) if ws is not None else len(sent)))
    return Reduced(mean, len(senders), None, tracked, **told)


def inf_if_nan(value: float) -> float:
    """A squared norm that held a NaN reads as inf: not finite either way."""
    return value if value == value else float("inf")
