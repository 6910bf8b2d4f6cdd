"""Guards on the run's health: non-finite pseudo-gradients (a worker left out of a sync, a
streak of them stops the run) and the replica check (every worker's global copy hashed and
compared, on the comm thread)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import NonFiniteError, ReplicaMismatchError
from ..protocols import SyncHooks
from ..transport import Transport
from .fragment import Fragment
from .state import RunState, StatePart
from .stats import SyncStats

log = logging.getLogger("lowcomm")


class NonFiniteGuard:
    """Fragments this worker left out (its update was non-finite) and the run's streak."""

    def __init__(self, patience: int, stats: SyncStats, state: RunState, rank: int = 0) -> None:
        self.patience, self.stats, self.rank = patience, stats, rank
        self.left_out: set[int] = set()  # fragments whose last pseudo-gradient here was bad
        self.streak = 0
        state.register(
            "left_out",
            StatePart(lambda: sorted(self.left_out), lambda v: self._load_left_out(v), fresh=[]),
        )
        state.register(
            "nonfinite_streak",
            StatePart(lambda: self.streak, lambda v: setattr(self, "streak", int(v)), kept=False),
        )

    def _load_left_out(self, value: list[int] | set[int]) -> None:
        self.left_out = set(value)

    def leave_out(self, frag: Fragment, step: int) -> None:
        """This worker's update of ``frag`` was non-finite: peers average without it."""
        self.left_out.add(frag.index)
        self.stats.left_out_here += 1
        log.warning(
            "rank %d: non-finite pseudo-gradient in fragment %d at step %d; left out "
            "of this sync, restarting from the global parameters",
            self.rank,
            frag.index,
            step,
        )

    def track(self, p: int, bad: int, workers: int, step: int) -> None:
        """Count syncs in which some worker was left out (``bad`` of ``workers`` in fragment
        ``p``'s); too many in a row stop the run."""
        if bad == 0:
            self.streak = 0
            return
        self.stats.left_out_syncs += 1
        self.streak += 1
        log.warning(
            "step %d: %d of %d workers left out of fragment %d's sync (non-finite "
            "pseudo-gradient); %d such syncs in a row",
            step,
            bad,
            workers,
            p,
            self.streak,
        )
        if self.streak >= self.patience:
            raise NonFiniteError(
                f"{self.streak} syncs in a row had non-finite pseudo-gradients "
                f"(last at inner step {step}): lower inner_lr, check the data, or resume "
                f"from the last checkpoint; nonfinite_patience={self.patience}"
            )


def checksum(flat: torch.Tensor) -> int:
    """The sum modulo 2**64 of a flat FP32 tensor's bits as 64-bit integers (an odd last
    element as a 32-bit one), exact and independent of the order of the additions."""
    even = flat.numel() // 2 * 2
    total = int(flat[:even].view(torch.int64).sum()) if even else 0
    if even < flat.numel():
        total += int(flat[even:].view(torch.int32))
    return total % 2**64


def global_checksum(frags: list[Fragment]) -> int:
    """:func:`checksum` of the whole global copy, over every fragment (unsigned 64-bit)."""
    return sum(checksum(f.global_flat) for f in frags) % 2**64


class ReplicaCheck:
    """Hash the global copies after a sync, compare every worker's hash later. In an elastic
    run of one-rank sites the comparison is a vote: the sites whose copy differs from a
    strict majority's leave (they stop, the others exclude them and go on; started again, a
    site heals from the majority); without a majority (two sites, or no copy held by more
    than half) the run stops, as a fixed world always does."""

    def __init__(
        self,
        transport: Transport,
        on_group: Callable[..., Any],
        stats: SyncStats,
        runner: Any,
        hooks: SyncHooks | None = None,
    ) -> None:
        self.transport, self.on_group, self.stats = transport, on_group, stats
        self.runner = runner  # the membership's runner (None in a fixed world)
        self.hooks = hooks or SyncHooks()  # checksum hooks may change what this site reports
        self._gathered: Future | None = None

    def start(self, frags: list[Fragment], tag: str) -> None:
        """Checksum the global copy now; gather every worker's on the comm thread.

        The checksum is the sum, modulo 2**64, of the copy's bits read as 64-bit integers: any
        one element that differs changes it, and it reads the copy once at memory speed (a
        SHA-256 of it cost about 10 memory passes, and a copy to bytes).
        """
        mine = torch.tensor([self.hooks.checksum(global_checksum(frags)) - 2**63])

        def gather(t: Transport, _: Any) -> tuple[torch.Tensor, Any]:
            # the view of the attempt that gathered them: whose hash is whose
            view = self.runner.current if self.runner is not None else None
            return t.all_gather(mine, control=True), view

        # queued behind any exchange in flight, so it never stalls the overlap
        self._gathered = self.transport.submit(lambda: (tag, *self.on_group(tag, gather)))

    def collect(self) -> None:
        """Compare the hashes of the last check, if one is in flight."""
        if self._gathered is None:
            return
        tag, gathered, view = self.transport.wait(self._gathered)
        self._gathered = None
        hashes = [int(h) for h in gathered]
        self.stats.replica_checks += 1
        if len(set(hashes)) == 1:
            return
        top, count = max(((h, hashes.count(h)) for h in hashes), key=lambda hc: hc[1])
        sites = view.members if view is not None else None
        if sites is None or self.runner.membership.ranks != 1 or 2 * count <= len(hashes):
            bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
            raise ReplicaMismatchError(
                f"global parameters differ between workers (ranks {bad} disagree with rank 0 after "
                f"sync {self.stats.syncs}; no copy is held by a majority): the replicas diverged; "
                f"resume from the last checkpoint"
            )
        self._outvoted([s for s, h in zip(sites, hashes) if h != top], tag, view)

    def _outvoted(self, minority: list[int], tag: str, view: Any) -> None:
        """The sites whose copy differs from the majority's leave: this one stops, the others
        exclude them (every member read the same hashes)."""
        why = f"its global copy differs from the majority's after {tag}"
        me = self.runner.membership.elastic.site
        if me in minority:
            raise ReplicaMismatchError(
                f"site {me}'s global parameters differ from those of a majority of the sites "
                f"after {tag} (sites {minority} differ): it leaves the run; started again, it "
                f"heals from the others"
            )
        # on the comm thread, where the membership reads its exclusions (a sync may be asking)
        exclude = self.runner.membership.exclude
        self.transport.wait(self.transport.submit(lambda: exclude(dict.fromkeys(minority, why),
                                                                  tag, view)))  # fmt: skip


def restart(frag: Fragment, optimizer: torch.optim.Optimizer) -> None:
    """A worker whose update of ``frag`` diverged restarts it from the global copy, with fresh
    inner optimizer state (its moments may hold the same NaN/Inf)."""
    frag.load_global()
    if frag.snapshot is not None:
        frag.snapshot.copy_(frag.global_flat)
    for param in frag.raw:
        optimizer.state.pop(param, None)
