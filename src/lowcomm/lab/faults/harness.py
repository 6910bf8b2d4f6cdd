"""A site acting out its own faults (see the package doc for the grammar), as a callback of the
trainer: :meth:`Harness.act` before each inner step arms them or acts at once (a kill, a pause,
a cut link); on the engine, the hooks it registers act on a sync's contribution, commit vote
and replica checksum, and the transports it wraps (:class:`SpoilingTransport`) on what the
site sends and where it dies inside a sync or a heal.

A run with faults makes one per site from the run's fault list; the engine knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.protocols import CommitVote, Contribution
from lowcomm.train.callbacks import TrainerCallback
from lowcomm.transport import Transport, TransportFactory, TransportWrapper

from . import ATTACKS, INSIDERS, LIGHTHOUSE_FAULT, Fault, cut_link, pace
from .forge import PAYLOAD_ATTACKS, forge

if TYPE_CHECKING:
    from lowcomm.engine import LowComm

#: how long a site waits for the launcher to take its request (then goes on)
ASK_S = 10.0


class Harness(TrainerCallback):
    """The faults of one site, acted out on itself. Holds what is armed: the points where it
    dies or stops inside a sync, a spoilt send, the attack it makes on every send from its step
    on, and (for ``copy`` and ``alie``) what every site sent last round, by payload size."""

    def __init__(self, faults: list[Fault], site: int, out: Path | None = None) -> None:
        self.faults, self.site, self.out = faults, site, out
        self.armed: set[str] = set()  # corrupt, healer, collective, stall; an insider's lies
        self.attacking: Fault | None = None
        # the sites of every alie attack (they know each other)
        self.colluders = sorted({f.site for f in faults if f.kind == "alie"})
        # last round's payloads, by which payload of which sync: (its fragments, its place)
        self.seen: dict[tuple[tuple[int, ...], int], list[torch.Tensor]] = {}
        self.engine: LowComm | None = None  # it acts on (its aggregator decodes for a forger)
        self.link_delay_s = 0.0  # slowlink: seconds each collective of its syncs waits first

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
            if f.kind == "ender" and self.engine is not None and self.engine.membership:
                self.engine.membership.ended()  # mid-run: a lie (see lowcomm.elastic.front)
            if f.kind == "slowlink":
                self.link_delay_s = f.factor or 0.0
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

    # -- the trainer's callback points -----------------------------------------------------------
    def on_step_begin(self, step: int) -> None:
        """Before inner step ``step``: :meth:`act`."""
        self.act(step)

    def on_step_end(self, step: int, compute_s: float) -> None:
        """After inner step ``step``: a ``slow:`` fault stretches its compute."""
        pace(self.faults, self.site, step, compute_s)

    def on_engine(self, engine: LowComm) -> None:  # type: ignore[override]
        """Act on the engine's syncs: its contributions, commit votes and replica checksums
        through its hooks (its payloads through :meth:`transports`)."""
        self.engine = engine
        if self.faults:
            engine.register_contribution_hook(self.contribution)
            engine.register_vote_hook(self.vote)
            engine.register_checksum_hook(self.checksum)

    def transports(self, make: TransportFactory) -> TransportFactory:
        """Every transport between sites wrapped in a :class:`SpoilingTransport` of this site
        (what it sends, and where it dies or stops inside a sync or a heal)."""
        if not self.faults:
            return make
        return lambda group, meter: SpoilingTransport(make(group, meter), self)

    # -- on a contribution, a vote, a checksum ----------------------------------------------------
    def contribution(self, c: Contribution) -> None:
        """An attack armed here (``signflip``, ``scale``, ``noise``, ``zero``, ``nan``,
        ``drift``, ``collude``), acted out in place on the contribution about to be encoded at
        ``c.step`` (its noise drawn from the site and step, so a replay sends the same); ``nan``
        and the drifts go past the error compensation."""
        f = self.attacking
        if f is None:
            return
        for i, t in enumerate(c.tensors):  # (copy and alie: on the payload, see forged)
            if f.kind == "signflip":
                t.neg_()
            elif f.kind == "scale":
                t.mul_(f.factor)
            elif f.kind == "zero":
                t.zero_()
            elif f.kind == "nan":
                t.fill_(float("nan"))
            elif f.kind == "noise" and t.numel():
                g = torch.Generator().manual_seed(f.site * 1_000_003 + c.step * 1_009 + i)
                noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
                t.add_(noise.to(t.device, t.dtype) * (f.factor * t.norm() / t.numel() ** 0.5))
            elif f.kind in ("drift", "collude") and t.numel():
                w = c.weights[i] if c.weights else None
                _drift(t, w, i, 0 if f.kind == "collude" else f.site + 1, f.factor or 1.0)
        # nan: its own NaN decode would stop the site itself; drift: a buffer would spread the
        # fixed direction's residual into the next syncs (a bad site need not keep buffers)
        if f.kind in ("nan", "drift", "collude"):
            c.compensate = False

    def vote(self, v: CommitVote) -> CommitVote | None:
        """An insider armed here (``dissent``, ``accuse``): its commit vote on every sync says
        the sync failed (``accuse``: naming the lowest other member's payload)."""
        if not v.tag.startswith("sync@") or not {"dissent", "accuse"} & self.armed:
            return None
        others = [m for m in v.members if m != self.site]
        if "accuse" in self.armed and others:
            why = f"payload from worker {others[0]} has validity flag 127"
            return dataclasses.replace(v, ok=False, blame=(others[0], why))
        return dataclasses.replace(v, ok=False, blame=None)

    def checksum(self, value: int) -> int | None:
        """A ``liar:`` armed here: the checksum it reports of its global copy, a constant."""
        return 12345 if "liar" in self.armed else None

    # -- on what it sends (through SpoilingTransport) ---------------------------------------------
    def outgoing(self, payloads: list[torch.Tensor]) -> None:
        """A ``corrupt:`` fault armed here: spoil the validity flag (the last byte of each row)
        of every payload of the sync about to be sent, once."""
        if "corrupt" not in self.armed:
            return
        self.armed.discard("corrupt")
        for payload in payloads:
            payload[..., -1] = 0x7F  # neither 0 (left out) nor 1 (valid): refused on decode

    def forged(self, payload: torch.Tensor, rank: int, key: Any) -> torch.Tensor:
        """The gather payload this site sends in place of ``payload`` (its own unless it acts
        out ``copy`` or ``alie``); ``key``: which payload of which sync (see
        :class:`SpoilingTransport`)."""
        f = self.attacking
        if f is None or f.kind not in PAYLOAD_ATTACKS or self.engine is None:
            return payload
        shapes = self._shapes(key)
        if shapes is None:
            return payload
        agg = self.engine.aggregator
        return forge(payload, shapes, rank, agg, self.seen.get(key), f.kind, self.colluders)

    def gathered(self, rows: list[torch.Tensor], key: Any) -> None:
        """What every site sent this round in one gather, kept for the next by a forger."""
        f = self.attacking
        if f is not None and f.kind in PAYLOAD_ATTACKS:
            self.seen[key] = [p.clone() for p in rows]

    def _shapes(self, key: tuple[tuple[int, ...], int]) -> list[torch.Size] | None:
        """The shapes of the ``key[1]``-th bucket of the fragments ``key[0]``, in the order
        their exchange sends them."""
        frags = self.engine.fragments
        buckets = [(p, b) for p in key[0] if p < len(frags) for b in frags[p].buckets]
        if key[1] >= len(buckets):
            return None
        p, bucket = buckets[key[1]]
        return [frags[p].params[i].shape for i in bucket]

    def at(self, point: str) -> None:
        """A fault armed here that kills this process at ``point`` (``healer``: inside a
        heal's hand-over; ``collective``: inside a sync's collectives), now; ``stall`` stops it
        inside the collectives instead (SIGSTOP)."""
        if point in self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "collective" and "stall" in self.armed:
            os.kill(os.getpid(), signal.SIGSTOP)


class SpoilingTransport(TransportWrapper):
    """A site's transport with its faults acted out on what it sends: a ``corrupt:`` flag on
    every payload of its next sync, a ``copy``/``alie`` payload forged from the last gather's,
    a death (``collective:``, ``healer:``) or stop (``stall:``) at its first sync payload or
    its first hand-over of a heal, and a ``slowlink:`` wait before each collective of its
    training traffic.

    A sync's exchange gathers every worker's control flags first (an int64 row whose second
    entry is the sync's step), then its fragments' payloads bucket by bucket: a payload is
    known by the fragments sent at that step and its place among them."""

    def __init__(self, inner: Transport, harness: Harness) -> None:
        super().__init__(inner)
        self.harness = harness
        self._sends: tuple[int, ...] = ()  # the fragments of the sync being exchanged
        self._place = 0  # ... and how many of its payloads were gathered so far

    def _training(self) -> None:
        """Before a collective of the training traffic: die or stop there if armed, wait as
        a slow link does."""
        self.harness.at("collective")
        if self.harness.link_delay_s > 0:
            time.sleep(self.harness.link_delay_s)

    def all_gather(self, t: torch.Tensor, control: bool = False) -> list[torch.Tensor]:
        """A sync's payloads (uint8, not control) spoilt or forged as armed; what came back
        seen by a forger."""
        h = self.harness
        if control and t.dtype == torch.int64 and t.dim() == 1 and h.engine is not None:
            if t.numel() > 1 and hasattr(h.engine, "schedule"):  # a sync's flags: its step
                self._sends, self._place = tuple(h.engine.schedule.sends_at(int(t[1]))), 0
        if control or t.dtype != torch.uint8:
            if not control:
                self._training()
            return self.inner.all_gather(t, control)
        self._training()
        h.outgoing([t])
        key = (self._sends, self._place)
        self._place += 1
        rows = self.inner.all_gather(h.forged(t, self.inner.rank, key), control)
        h.gathered(rows, key)
        return rows

    def all_to_all(self, chunks: list[torch.Tensor], control: bool = False) -> list[torch.Tensor]:
        """A two-phase sync's chunks spoilt as armed."""
        if not control:
            self._training()
            self.harness.outgoing(chunks)
        return self.inner.all_to_all(chunks, control)

    def all_reduce(self, t: torch.Tensor, control: bool = False, op: str = "sum") -> torch.Tensor:
        """A sync's all-reduce: where a ``collective:`` or ``stall:`` fault acts."""
        if not control:
            self._training()
        return self.inner.all_reduce(t, control, op)

    def all_reduce_async(self, t: torch.Tensor, control: bool = False) -> Any:
        """A per-step gradient all-reduce (DDP's hook): a slow link waits first."""
        if not control:
            self._training()
        return self.inner.all_reduce_async(t, control)

    def exchange_p2p(
        self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], control: bool = True
    ) -> None:
        """A heal's hand-over: where a ``healer:`` fault dies, as this site sends its part."""
        if sends:
            self.harness.at("healer")
        self.inner.exchange_p2p(sends, recvs, control)


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
