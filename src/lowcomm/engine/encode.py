"""One fragment's contribution to a sync: its pseudo-gradient, compensated (error feedback or
LoCo's moving average) and encoded per bucket by the aggregator's codec."""

from __future__ import annotations

from typing import Any

import torch

from ..aggregate import Aggregator, Encoded, encode_compensated
from ..aggregate.base import Valid
from ..protocols import Contribution, SyncHooks
from ..transport import Transport
from .fragment import Fragment
from .guards import NonFiniteGuard
from .tensors import Slabs, all_finite, finite_flag


class Encoder:
    """Turns fragments into payloads (a non-finite one is reported to the guard).

    Each fragment's pseudo-gradient is written into persistent slabs (no model-sized temporary
    per sync); with ``in_flight=2`` (CO2: a round's average lands only at the next send, after
    that send was encoded) two sets alternate.
    """

    def __init__(
        self,
        aggregator: Aggregator,
        compensation: Any,
        guard: NonFiniteGuard,
        rank: int,
        hooks: SyncHooks,
        in_flight: int = 1,
    ) -> None:
        self.aggregator, self.compensation = aggregator, compensation
        self.guard, self.rank, self.hooks = guard, rank, hooks
        self.in_flight = in_flight
        self._slabs: dict[int, list[Slabs]] = {}
        self._sends: dict[int, int] = {}
        self._defers: dict[int, bool] = {}

    def slabs(self, frag: Fragment) -> Slabs:
        """The slabs this send of ``frag`` writes (allocated at its first sends)."""
        sets = self._slabs.setdefault(frag.index, [])
        n = self._sends.get(frag.index, 0)
        self._sends[frag.index] = n + 1
        if len(sets) <= n % self.in_flight:
            sets.append(Slabs(frag.params, frag.buckets, frag.global_flat.device))
        return sets[n % self.in_flight]

    def count_step(self, transport: Transport) -> None:
        """Count one inner optimizer step for the error buffers' periodic resets (the
        two-phase reduce's own on the comm thread, after the exchanges queued before it)."""
        if self.compensation is not None:
            self.compensation.step()
        if self.aggregator.reduce_compensation is not None:
            transport.submit(self.aggregator.step)

    def encode(
        self, frag: Fragment, step: int, defer: bool = True
    ) -> tuple[list[Encoded], torch.Tensor | None, bool]:
        """One fragment's pseudo-gradient, compensated and encoded per bucket.

        Returns the payloads, what this worker sent decoded (for the continue merge) and
        whether its update was found non-finite here. A fragment without inner steps since its
        last send (a worker that has left its loop) is not contributed; a non-finite one is
        left out: peers average without it and its error buffer is not polluted. Where the
        aggregator :meth:`~lowcomm.aggregate.Aggregator.defers`, the finite check is not read
        here: the payload carries it, and the exchange's result tells (``left_out_here``);
        ``defer=False`` reads it here all the same (the exit's last exchange, applied apart).
        """
        slabs = self.slabs(frag)
        need_own = frag.snapshot is not None  # continue merge: keep what is sent, and the weights
        finite = frag.pseudo_grad_into(slabs.views, take_snapshot=need_own)
        contributes = frag.unsent > 0
        valid, nonfinite = self._valid(frag, slabs, finite, contributes, defer)
        if nonfinite:
            self.guard.leave_out(frag, step)
        compensation = self.compensation
        sends = contributes and not nonfinite
        if sends:  # contribution hooks act here: past the site's own checks, before encoding
            weights = [frag.global_views[i] for g in frag.buckets for i in g]  # views' order
            c = self.hooks.contribution(Contribution(step, slabs.views, weights))
            if not c.compensate:
                compensation = None
        encoded = self._buckets(frag, slabs, valid, need_own, compensation)
        own = None
        if need_own:
            own = slabs.own()
            if sends:  # a copy: own never aliases a payload (unread if left out after all)
                torch.cat([e.local for e in encoded], out=own)  # type: ignore[misc]
            else:
                own.zero_()
            for e in encoded:
                e.local = None  # kept in own: the exchange may now reduce the payload in place
        for e, slab in zip(encoded, slabs.slabs):
            if e.payload is not slab:  # the slab is free again: the mean may land there
                e.out = slab[:-1]
        frag.unsent = 0
        return encoded, own, nonfinite

    def _valid(
        self, frag: Fragment, slabs: Slabs, finite: bool | None, contributes: bool, defer: bool
    ) -> tuple[Valid, bool]:
        """Whether ``frag``'s update goes out valid (a 0-d bool on the device where the
        aggregator takes one and ``defer``: nothing read), and whether it was found non-finite
        here."""
        if contributes and defer and self._deferred(frag, slabs):
            dev = slabs.slabs[0].device
            if finite is not None:  # the CPU's fused kernel found out already
                return torch.tensor(finite, device=dev), False
            return finite_flag(*(s[:-1] for s in slabs.slabs)), False
        if contributes and finite is None:
            finite = all_finite(*(s[:-1] for s in slabs.slabs))
        nonfinite = contributes and not finite
        return contributes and not nonfinite, nonfinite

    def _deferred(self, frag: Fragment, slabs: Slabs) -> bool:
        """Whether every bucket of ``frag`` may carry a device flag (see :meth:`_valid`)."""
        if not self.aggregator.deferred_checks or not slabs.slabs:
            return False
        if frag.index not in self._defers:
            comp, dev = self.compensation, slabs.slabs[0].device
            flat_ok = comp is None or (hasattr(comp, "flat_on") and comp.flat_on(dev))
            self._defers[frag.index] = flat_ok and all(
                self.aggregator.defers([slabs.views[i].shape for i in b], dev, comp is not None)
                for b in frag.buckets
            )
        return self._defers[frag.index]

    def _buckets(
        self, frag: Fragment, slabs: Slabs, valid: Valid, need_own: bool, compensation: Any
    ) -> list[Encoded]:
        """Encode per bucket, through the error compensation when there is one (error feedback:
        e <- beta e + delta, send e, e <- e - sent; LoCo: h = delta + e, e <- moving average of
        h - sent). The key names each bucket's buffer for a compensated two-phase reduce.
        Without compensation a bucket's slab is offered to the aggregator as its payload."""
        encoded = []
        for b, bucket in enumerate(frag.buckets):
            names, tensors = [frag.names[i] for i in bucket], [slabs.views[i] for i in bucket]
            key = f"fragment {frag.index} bucket {b}"
            slab = slabs.slabs[b]
            # a bucket the aggregator encodes at once is handed over as one flat buffer
            whole = self.aggregator.plan([t.shape for t in tensors], slab.device) is not None
            flat = slab[:-1] if whole else None
            if compensation is None:
                encoded.append(
                    self.aggregator.encode(
                        tensors, need_local=need_own, valid=valid, key=key, slab=slab, flat=flat
                    )
                )
            else:
                encoded.append(
                    encode_compensated(
                        self.aggregator,
                        compensation,
                        names,
                        tensors,
                        valid,
                        key=key,
                        need_dense=need_own,
                        flat=flat,
                    )
                )
        return encoded
