"""One fragment's contribution to a sync: its pseudo-gradient, compensated (error feedback or
LoCo's moving average) and encoded per bucket by the aggregator's codec."""

from __future__ import annotations

from typing import Any

import torch

from ..aggregate import Aggregator, Encoded, encode_compensated
from ..transport import Transport
from .fragment import Fragment
from .guards import NonFiniteGuard
from .tensors import all_finite, views


class Encoder:
    """Turns fragments into payloads (a non-finite one is reported to the guard)."""

    def __init__(
        self, aggregator: Aggregator, compensation: Any, guard: NonFiniteGuard, rank: int
    ) -> None:
        self.aggregator, self.compensation = aggregator, compensation
        self.guard, self.rank = guard, rank

    def count_step(self, transport: Transport) -> None:
        """Count one inner optimizer step for the error buffers' periodic resets (the
        two-phase reduce's own on the comm thread, after the exchanges queued before it)."""
        if self.compensation is not None:
            self.compensation.step()
        if self.aggregator.reduce_compensation is not None:
            transport.submit(self.aggregator.step)

    def encode(self, frag: Fragment, step: int) -> tuple[list[Encoded], torch.Tensor | None, bool]:
        """One fragment's pseudo-gradient, compensated and encoded per bucket.

        Returns the payloads, what this worker sent decoded (for the continue merge) and
        whether its update was non-finite. A fragment without inner steps since its last send
        (a worker that has left its loop) is not contributed; a non-finite one is left out:
        peers average without it and its error buffer is not polluted.
        """
        pseudo_grad = frag.pseudo_grad()
        contributes = frag.unsent > 0
        nonfinite = contributes and not all_finite(pseudo_grad)
        if nonfinite:
            self.guard.leave_out(frag, self.rank, step)
        valid = contributes and not nonfinite
        need_own = frag.snapshot is not None
        encoded = self._buckets(frag, pseudo_grad, valid, need_own)
        own = None
        if need_own:
            own = (  # cat copies: own never aliases a payload
                torch.cat([e.local for e in encoded])  # type: ignore[misc]
                if valid
                else torch.zeros_like(pseudo_grad)
            )
            frag.take_snapshot()
        frag.unsent = 0
        return encoded, own, nonfinite

    def _buckets(
        self, frag: Fragment, pseudo_grad: torch.Tensor, valid: bool, need_own: bool
    ) -> list[Encoded]:
        """Encode per bucket, through the error compensation when there is one (error feedback:
        e <- beta e + delta, send e, e <- e - sent; LoCo: h = delta + e, e <- moving average of
        h - sent). The key names each bucket's buffer for a compensated two-phase reduce."""
        grads = views(pseudo_grad, frag.params)
        encoded = []
        for b, bucket in enumerate(frag.buckets):
            names, tensors = [frag.names[i] for i in bucket], [grads[i] for i in bucket]
            key = f"fragment {frag.index} bucket {b}"
            if self.compensation is None:
                encoded.append(
                    self.aggregator.encode(tensors, need_local=need_own, valid=valid, key=key)
                )
            else:
                encoded.append(
                    encode_compensated(
                        self.aggregator, self.compensation, names, tensors, valid, key=key
                    )
                )
        return encoded
