"""A site acting out its own faults (see the package doc for the grammar): the hooks the engine
calls at fixed points of a sync (:class:`lowcomm.protocols.FaultHooks`), and :meth:`Harness.act`
before each inner step, which arms them or acts at once (a kill, a pause, a cut link).

The trainer builds one per site from the run's fault list and hands it to the engine
(``engine.faults = harness``) before the block starts; a run without faults hands nothing in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from . import ATTACKS, INSIDERS, LIGHTHOUSE_FAULT, Fault, cut_link
from .forge import PAYLOAD_ATTACKS, forge

#: how long a site waits for the launcher to take its request (then goes on)
ASK_S = 10.0


class Harness:
    """The faults of one site, acted out on itself. Holds what is armed: the points where it
    dies or stops inside a sync, a spoilt send, the attack it makes on every send from its step
    on, and (for ``copy`` and ``alie``) what every site sent last round."""

    def __init__(self, faults: list[Fault], site: int, out: Path | None = None) -> None:
        self.faults, self.site, self.out = faults, site, out
        self.armed: set[str] = set()  # corrupt, healer, collective, stall; an insider's lies
        self.attacking: Fault | None = None
        # the sites of every alie attack (they know each other)
        self.colluders = sorted({f.site for f in faults if f.kind == "alie"})
        self.seen: dict[Any, list[torch.Tensor]] = {}  # last round's payloads, by group

    # -- before each inner step ------------------------------------------------------------------
    def act(self, step: int) -> None:
        """Before inner step ``step``: arm the faults due now, or carry them out on this process
        (``lighthouse:`` on the launcher's, through a file in the run's folder: the site goes
        on once the launcher has killed it, so the fault lands before this very step)."""
        for f in self.faults:
            if f.site != self.site or f.step != step:
                continue
            if f.kind in ("corrupt", "healer", "collective", "stall", *INSIDERS):
                self.armed.add(f.kind)
            if f.kind in ATTACKS:
                self.attacking = f
            if f.kind == "lighthouse" and self.out is not None:
                self._ask_launcher(f)
            if f.kind == "pause":  # the helper outlives nothing: it wakes this process, then ends
                pid = os.getpid()
                subprocess.Popen(["sh", "-c", f"sleep {f.factor:g}; kill -CONT {pid}"])
            if f.kind == "link":
                cut_link(f.factor or 0.0)
            if f.kind in ("kill", "hang", "pause"):
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)

    def _ask_launcher(self, f: Fault) -> None:
        assert self.out is not None
        ask = self.out / LIGHTHOUSE_FAULT
        ask.write_text(f"{f.factor:g}\n")
        deadline = time.monotonic() + ASK_S
        while ask.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    # -- the hooks a sync calls ------------------------------------------------------------------
    def contribution(
        self,
        tensors: list[torch.Tensor],
        step: int,
        compensation: Any,
        weights: list[torch.Tensor] | None = None,
    ) -> Any:
        """An attack armed here (``signflip``, ``scale``, ``noise``, ``zero``, ``nan``,
        ``drift``, ``collude``), acted out in place on the contribution about to be encoded at
        ``step`` (its noise drawn from the site and step, so a replay sends the same). Returns
        the compensation to encode it through: none for ``nan`` and the drifts."""
        f = self.attacking
        if f is None:
            return compensation
        for i, t in enumerate(tensors):  # (copy and alie: on the payload, see forged)
            if f.kind == "signflip":
                t.neg_()
            elif f.kind == "scale":
                t.mul_(f.factor)
            elif f.kind == "zero":
                t.zero_()
            elif f.kind == "nan":
                t.fill_(float("nan"))
            elif f.kind == "noise" and t.numel():
                g = torch.Generator().manual_seed(f.site * 1_000_003 + step * 1_009 + i)
                noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
                t.add_(noise.to(t.device, t.dtype) * (f.factor * t.norm() / t.numel() ** 0.5))
            elif f.kind in ("drift", "collude") and t.numel():
                w = weights[i] if weights is not None else None
                _drift(t, w, i, 0 if f.kind == "collude" else f.site + 1, f.factor or 1.0)
        # nan: its own NaN decode would stop the site itself; drift: a buffer would spread the
        # fixed direction's residual into the next syncs (a bad site need not keep buffers)
        return None if f.kind in ("nan", "drift", "collude") else compensation

    def outgoing(self, payloads: list[torch.Tensor]) -> None:
        """A ``corrupt:`` fault armed here: spoil the validity flag (the last byte of each row)
        of every payload of the sync about to be sent, once."""
        if "corrupt" not in self.armed:
            return
        self.armed.discard("corrupt")
        for payload in payloads:
            payload[..., -1] = 0x7F  # neither 0 (left out) nor 1 (valid): refused on decode

    def forged(
        self, payload: torch.Tensor, shapes: list[torch.Size], rank: int, agg: Any, key: Any
    ) -> torch.Tensor:
        """The gather payload this site sends in place of ``payload`` (its own unless it acts
        out ``copy`` or ``alie``)."""
        f = self.attacking
        if f is None or f.kind not in PAYLOAD_ATTACKS:
            return payload
        last = self.seen.get(key or tuple(shapes))
        return forge(payload, shapes, rank, agg, last, f.kind, self.colluders)

    def gathered(self, shapes: list[torch.Size], rows: list[torch.Tensor], key: Any) -> None:
        """What every site sent this round of group ``key``, kept for the next by a forger."""
        f = self.attacking
        if f is not None and f.kind in PAYLOAD_ATTACKS:
            self.seen[key or tuple(shapes)] = [p.clone() for p in rows]

    def vote(
        self, tag: str, ok: bool, blame: tuple[int, str] | None, members: list[int]
    ) -> tuple[bool, tuple[int, str] | None]:
        """An insider armed here (``dissent``, ``accuse``): its commit vote on every sync says
        the sync failed (``accuse``: naming the lowest other member's payload)."""
        if not tag.startswith("sync@") or not {"dissent", "accuse"} & self.armed:
            return ok, blame
        others = [m for m in members if m != self.site]
        if "accuse" in self.armed and others:
            return False, (others[0], f"payload from worker {others[0]} has validity flag 127")
        return False, None

    def checksum(self, value: int) -> int:
        """A ``liar:`` armed here: the checksum it reports of its global copy, a constant."""
        return 12345 if "liar" in self.armed else value

    def at(self, point: str) -> None:
        """A fault armed here that kills this process at ``point`` (``healer``: inside a
        heal's hand-over; ``collective``: inside a sync's collectives), now; ``stall`` stops it
        inside the collectives instead (SIGSTOP)."""
        if point in self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "collective" and "stall" in self.armed:
            os.kill(os.getpid(), signal.SIGSTOP)


def _drift(t: torch.Tensor, w: torch.Tensor | None, i: int, who: int, factor: float) -> None:
    """``t`` (tensor ``i`` of a contribution) replaced in place by a direction that shrinks
    every weight toward 0 (``w``: the merge subtracts it), at ``factor`` times ``t``'s own norm.
    (Growing every magnitude instead, ``-w``, lowered the loss of 8 sites of ``tiny`` over 30
    syncs by 4-5 %: at that scale it is no attack.)
    ``who`` 0 (colluders): on every entry, so on top-k all colluders pick the same (largest)
    weights and vouch for each other; else on half the entries, a fixed half of that site's own
    (drawn from ``who`` and ``i``), so drifting sites pick apart. Without ``w``: a fixed random
    direction of the same draw."""
    g = torch.Generator().manual_seed(who * 1_000_003 + i * 7_919 + t.numel())
    if w is None:
        u = torch.randn(t.shape, generator=g, dtype=torch.float32)
    else:
        u = w.detach().to("cpu", torch.float32).reshape(t.shape)
        if who:
            u = u * (torch.rand(t.shape, generator=g) < 0.5)
    u = u.to(t.device, t.dtype)
    t.copy_(u * (factor * t.norm() / u.norm().clamp_min(1e-30)))
