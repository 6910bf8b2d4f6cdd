"""Leaving the ``with`` block (the own-loop contract of docs/api.md): wait until every worker
has left, drain what is in flight, one more blocking outer step per fragment with unsent inner
steps, and average the buffers: the consolidated model that leaving publishes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from .. import _buffers
from ..outer import OuterOptimizer
from ..transport import Transport
from .fragment import Fragment
from .placement import Placement
from .sync import DONE, Exchange, InFlight, unsent_of


class Leave:
    """The exit path: join the peers, drain, the final outer step, the buffers."""

    def __init__(
        self,
        model: nn.Module,
        frags: list[Fragment],
        placement: Placement,
        *,
        transport: Transport,
        exchange: Exchange,
        inflight: InFlight,
        outer: OuterOptimizer,
        consumed: int,
    ) -> None:
        self.model, self.frags, self.placement = model, frags, placement
        self.transport, self.exchange, self.inflight = transport, exchange, inflight
        self.outer = outer
        # inner steps after a send that its result's merge consumes: tau under replace or the
        # alpha-mix (the steps in flight), 0 under continue (sent with the next send)
        self.consumed = consumed

    def join_peers(
        self, step: int, run_due: Callable[[int, bool], torch.Tensor | None]
    ) -> tuple[list[int], int]:
        """Mirror the peers' remaining syncs until every worker has left; the most unsent
        inner steps of any worker, per fragment, and the (mirrored) step at which all had left.

        A worker that is done contributes its unsent progress at the next sync of each fragment
        and then takes part without contributing, so uneven step counts never hang.
        """
        while True:
            step += 1
            flags = run_due(step, True)
            if flags is not None:
                return unsent_of(flags).max(dim=0).values.tolist(), step

    def everyone_left(self, flags: torch.Tensor) -> bool:
        """Whether the gathered flags say every worker has left its loop."""
        return bool((flags[:, DONE] == 1).all())

    def drain(self, apply: Callable[..., None]) -> None:
        """Apply every result still in flight (with the fragment's usual merge)."""
        for p in sorted(self.inflight.pending):
            reduced, own, event = self.inflight.take(p)
            with torch.no_grad():
                apply(p, reduced, own, event, final=True)

    def final_outer_step(
        self, unsent: list[int], step: int, encode: Callable[[Fragment, int, bool], Any]
    ) -> None:
        """One blocking outer step for each fragment some worker has inner steps in that no
        result holds: steps after its last send that its last merge did not consume.

        ``unsent`` is the most inner steps any worker took since the fragment's last send (the
        gathered flags, so every worker decides alike). At most ``consumed`` of them means its
        last result was applied after the last inner step (it landed then, or was drained):
        the merge already took them, and another outer step would move the global copy by
        its momentum alone.
        """
        todo = [p for p, n in enumerate(unsent) if n > self.consumed]
        if not todo:
            return
        encoded = {}
        for p in todo:
            # its result is applied here, not by Apply: the finite check is read first
            encoded[p], _, _ = encode(self.frags[p], step, False)
        flags = self.exchange.flags(step, done=True).unsqueeze(0)  # everyone is here: no gather
        job = self.exchange.job(encoded, None, flags, f"final@{step}", with_buffers=False)
        event = self.transport.blocking(job)
        with torch.no_grad():
            for p in todo:
                reduced = event.reduced[p]
                if reduced.valid_workers > 0:
                    frag = self.frags[p]
                    self.outer.step(
                        frag.key, frag.global_flat, reduced.mean.to(frag.global_flat.device)
                    )

    def sync_buffers(self, step: int) -> None:
        """Floating buffers averaged (or rank 0's), integer ones and frozen weights rank 0's."""
        buffers = self.exchange.buffers
        flat = _buffers.float_flat(self.model) if buffers == "average" else None

        def collectives(transport: Transport, buffer_transport: Transport) -> Tensor | None:
            self.placement.broadcast_constants(transport, buffers, buffers == "broadcast")
            return self.exchange.exchange_buffers(
                None if flat is None else flat.clone(),
                buffer_transport,  # reduced in place
            )

        averaged = self.transport.blocking(
            lambda: self.exchange.on_group(f"buffers@{step}", collectives)
        )
        if averaged is not None:
            _buffers.load_float_flat(self.model, averaged)
