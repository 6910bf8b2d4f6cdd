"""LoCo as a DDP communication hook: compensated low-bit gradient reduction every step.

Per bucket, its tensors are split into parts, each one collective through an
:class:`~lowcomm.aggregate.Aggregator` (:func:`~lowcomm.aggregate.aggregator_for` picks it):

- 1-D tensors (biases, norm weights) go as FP32, uncompressed (the LoCo authors' choice; they are
  few elements and sensitive), unless ``compress_1d``; their bytes are counted like the rest;
- the other tensors are compensated (``h = g + e``; send ``Q(h)``;
  ``e <- beta e + (1 - beta)(h - D(Q(h)))``) and quantised, one part per scale-group size.

For M <= 2 workers a part is all-gathered and summed in FP32 (one quantisation); for M >= 3 it
takes the two-phase reduce, whose second quantisation (the averaged shard this worker owns) is
compensated by the same rule with its own buffers (docs/algorithms.md, LoCo). Every buffer is
reset each ``reset_every`` optimizer steps (default 1024, the authors' period).

fp16: a bucket with a non-finite gradient on any worker comes back as NaN on every worker (so a
``GradScaler`` sees the overflow and skips the step) and the buffers are dropped before the next
step. The buffers hold errors of *scaled* gradients, so they follow the loss scale: pass the
``GradScaler`` as ``scaler=`` (read at each step's first bucket), or call
``follow_scaler(scaler)`` before training and after each ``scaler.update()``.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations at runtime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..aggregate import (
    Aggregator,
    AllReduceAggregator,
    Encoded,
    aggregator_for,
    encode_compensated,
)
from ..codecs.kernels import finite_flag
from ..compensation import DEFAULT_RESET_EVERY, MovingAverageCompensation
from ..errors import ConfigError
from ..transport import Transport
from .ddp import GradReduceState
from .loco_common import DEFAULT_QUANTIZER, LossScale, check_quantizer, group_for, loco_codec


@dataclass
class _Part:
    """Tensors of one bucket that go through one collective."""

    aggregator: Aggregator
    index: list[int]  # positions in the bucket
    key: str | None  # the reduce-side buffer's name (compressed parts only)
    compensated: bool


class LoCoState(GradReduceState):
    """State of the LoCo hook: quantiser, compensation buffers (both quantisations), aggregators.

    Buffers are keyed by parameter *name* (DDP rebuilds its buckets after the first iteration,
    so bucket indices are not stable), stored in ``storage_dtype`` on ``state_device`` (None:
    where the gradients are, sparing a copy each step; ``"cpu"`` saves accelerator memory).
    ``quantizer`` is ``ours`` or ``authors`` (see :mod:`lowcomm.hooks.loco_common`); ``reduce``
    forces ``gather`` or ``two-phase`` (``auto``: gather for M <= 2, where it costs the same
    wire bytes with one quantisation, else two-phase, whose bytes stay about 2 x payload).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        transport: Transport | None = None,
        bits: int = 4,
        beta: float = 0.8,
        group_size: int = 128,
        reset_every: int = DEFAULT_RESET_EVERY,
        storage_dtype: torch.dtype = torch.float32,
        reduce: str = "auto",
        compensate: bool = True,
        state_device: str | None = None,
        quantizer: str = DEFAULT_QUANTIZER,
        compress_1d: bool = False,
        scaler: Any = None,
    ) -> None:
        super().__init__(transport if transport is not None else Transport())
        check_quantizer(quantizer, bits)
        if reduce not in ("auto", "gather", "two-phase"):
            raise ConfigError(f"LoCo reduce must be auto, gather or two-phase, got {reduce!r}")
        module = getattr(model, "module", model)  # accept the DDP wrapper or the bare model
        self.name_of = {id(p): n for n, p in module.named_parameters()}
        m = self.transport.world_size
        self.method = reduce if reduce != "auto" else ("gather" if m <= 2 else "two-phase")
        self.bits, self.group_size, self.quantizer = bits, group_size, quantizer
        self.compress_1d = compress_1d

        def make() -> MovingAverageCompensation:
            return MovingAverageCompensation(
                beta, dtype=storage_dtype, device=state_device, reset_every=reset_every
            )

        self.compensation = make() if compensate else None
        # the second quantisation's buffers: only this worker's averaged shards
        self.reduce_compensation = make() if compensate and self.method == "two-phase" else None
        self.loss_scale = LossScale(self.compensation, self.reduce_compensation)
        self._dense = AllReduceAggregator(m)
        self._by_group: dict[int, Aggregator] = {}
        self._plans: dict[tuple[str, ...], list[_Part]] = {}
        self.scaler = scaler
        self._overflow = False  # set from the comm thread, acted on by the next step's first bucket
        self._step_start = True

    @property
    def codec(self) -> Any:
        """The codec for groups of ``group_size`` (every tensor with ``ours``; with the authors'
        quantiser, the tensors that have no matrix shape)."""
        return self._aggregator(self.group_size).codec

    def _aggregator(self, group: int) -> Aggregator:
        agg = self._by_group.get(group)
        if agg is None:
            codec = loco_codec(self.quantizer, self.bits, group)
            agg = self._by_group[group] = aggregator_for(
                self.method,
                codec,
                self.transport.world_size,
                reduce_compensation=self.reduce_compensation,
            )
        return agg

    def plan(self, names: list[str], shapes: list[torch.Size]) -> list[_Part]:
        """How one bucket's tensors are sent: FP32 1-D part, one quantised part per group size."""
        cached = self._plans.get(tuple(names))
        if cached is not None:
            return cached
        dense = [i for i, s in enumerate(shapes) if len(s) <= 1 and not self.compress_1d]
        dense_set = set(dense)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(shapes):
            if i not in dense_set:
                groups.setdefault(group_for(self.quantizer, s, self.group_size), []).append(i)
        parts = [_Part(self._dense, dense, None, False)] if dense else []
        for g, idx in groups.items():
            # by name: the same layout (and reduce-side buffers) whatever order DDP's bucket has
            idx.sort(key=lambda i: names[i])
            key = f"{names[idx[0]]}..{names[idx[-1]]}[{len(idx)} tensors, groups of {g}]"
            parts.append(_Part(self._aggregator(g), idx, key, True))
        self._plans[tuple(names)] = parts
        return parts

    def follow_scaler(self, scaler: Any) -> None:
        """Call before training and after each ``scaler.update()``: the buffers follow the scale."""
        self.loss_scale.follow(scaler)

    def set_loss_scale(self, scale: float) -> None:
        """Your own loss scaling: the scale of the next backward (a drop resets the buffers)."""
        self.loss_scale.update(scale)

    def step(self) -> None:
        """Count one optimizer step on both buffer sets (the hook calls it on the last bucket)."""
        if self.compensation is not None:
            self.compensation.step()
        if self.reduce_compensation is not None:
            # ordered after this step's exchanges, which use these buffers on the comm thread
            self.transport.submit(self.reduce_compensation.step)

    def state_dict(self) -> dict:
        """The compensation buffers and step counters (tensors and plain types only)."""
        comp, red = self.compensation, self.reduce_compensation
        return {
            "compensation": comp.state_dict() if comp else {},
            "reduce_compensation": red.state_dict() if red else {},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore from ``state_dict()``."""
        if self.compensation is not None:
            self.compensation.load_state_dict(sd["compensation"])
        if self.reduce_compensation is not None and sd.get("reduce_compensation"):
            self.reduce_compensation.load_state_dict(sd["reduce_compensation"])


def loco_hook(state: LoCoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """LoCo: compensated low-bit gradient reduction of one DDP bucket; non-blocking.

    Compensation and encoding run here, on the backward thread; the exchanges run in order on
    the transport's comm thread while backward continues.
    """
    if state._step_start:
        _start_step(state)
    buf, grads = bucket.buffer(), bucket.gradients()
    names = [state.name_of[id(p)] for p in bucket.parameters()]
    parts = state.plan(names, [g.shape for g in grads])
    t0 = time.perf_counter()
    with torch.no_grad():
        # one host read per bucket, on purpose: whether this worker's gradient is finite decides
        # what it sends (its validity flag) and whether its error buffers may take it
        valid = bool(finite_flag(*grads))
        encoded = [
            encode_compensated(
                part.aggregator,
                state.compensation if part.compensated else None,
                [names[i] for i in part.index],
                torch.cat([grads[i].reshape(-1) for i in part.index]).float(),
                [grads[i].shape for i in part.index],
                [len(part.index)],
                valid,
                part.key,
                need_dense=part.compensated,
            )
            for part in parts
        ]
    state.work_s += time.perf_counter() - t0  # encoding: not computing (the trainer's clock)
    # handed to the network now: backward's time after the last launch is waiting, and must not
    # count the encode above a second time
    state.launched()
    offsets = [0]
    for g in grads:
        offsets.append(offsets[-1] + g.numel())
    fut = _exchange(state, buf, parts, encoded, offsets)
    if bucket.is_last():
        state.step()  # reset_every counts optimizer steps, not buckets (queued after the exchange)
        state._step_start = True
    return fut


def _start_step(state: LoCoState) -> None:
    """Before a step's first bucket: act on last step's overflow and on a new loss scale."""
    state._step_start = False
    if state._overflow:  # some worker overflowed: drop the errors of its scaled gradients
        state.loss_scale.reset()
        state._overflow = False
    if state.scaler is not None:
        state.loss_scale.follow(state.scaler)


def _exchange(
    state: LoCoState,
    buf: torch.Tensor,
    parts: list[_Part],
    encoded: list[Encoded],
    offsets: list[int],
) -> torch.futures.Future[torch.Tensor]:
    """Run every part's exchange on the comm thread; write the means into ``buf``."""
    transport = state.transport
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def job() -> None:
        for part, enc in zip(parts, encoded):
            red = part.aggregator.exchange(enc, transport)
            mean = red.mean
            if red.valid_workers < transport.world_size:  # an overflow somewhere: NaN everywhere
                state._overflow = True
                mean = torch.full_like(mean, float("nan"))
            at = 0
            for i in part.index:
                n = offsets[i + 1] - offsets[i]
                buf[offsets[i] : offsets[i + 1]].copy_(mean[at : at + n])
                at += n

    def done(f: Any) -> None:
        try:
            f.result()
            result.set_result(buf)
        except Exception as e:  # surface the failure in backward, not on the comm thread
            result.set_exception(e)

    transport.submit(job).add_done_callback(done)
    return result
