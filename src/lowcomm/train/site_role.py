"""A site's part in an elastic run, as the trainer sees it: who it is, what its launcher
staged for it, the trainer's control collectives on the live quorum, and the membership
record."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..transport import ByteMeter

if TYPE_CHECKING:
    from ..protocols import SyncEngine
    from .summary import RunSummary


@dataclass(frozen=True)
class Staged:
    """What the local launcher stages for one site process: a joiner's gate (a site started
    on standby, let in once the site it replaces has left) and what the process runs first
    (an extension's: its network namespace, say). Nothing of it exists in a deployed site."""

    gate: object = None  # a multiprocessing Event set to let a standby joiner in
    setup: Callable[[], None] | None = None  # run in the site's process before anything else


#: a site with nothing staged
NOT_STAGED = Staged()


@dataclass(frozen=True)
class FixedWorld:
    """A worker of a fixed world: no membership; the questions a site answers, answered for
    one that is not (the trainer asks its place, never whether it has one)."""

    elastic: ClassVar[bool] = False
    alone: ClassVar[bool] = False  # its folder is the run's
    join: ClassVar[bool] = False  # it starts with the run
    staged: ClassVar[Staged] = NOT_STAGED  # the launcher stages nothing for it
    starting: ClassVar[int] = 0  # the world does not change size
    peer_lighthouse: ClassVar[str] = ""  # a peer library finds its own world


@dataclass(frozen=True)
class ElasticSite:
    """A site process of an elastic run: its place in the run, and how it enters it."""

    elastic: ClassVar[bool] = True
    site: int
    sites: int
    lighthouse: str
    leave_after: str = ""  # replay: the sync after which this site left in the recorded run
    peer_lighthouse: str = ""  # torchft-diloco: the lighthouse of torchft's own Managers
    join: bool = False  # this process joins the running run (started again after it left)
    join_from: int = 0  # ... at the run's first sync at or after this step
    join_at: str = ""  # ... or exactly at this sync (a replay)
    heal_at: tuple[str, ...] = ()  # a replay: the syncs where sites joined in the recorded run
    starting: int = 0  # how many sites start the run (0: ``sites``; fewer when some are added)
    # launched on its own (site=): it starts with the others or joins the running run, as the
    # lighthouse says, and its folder is its own (it writes its files whoever else is in)
    alone: bool = False
    back: bool = False  # ... into its folder's unfinished run: it only joins the run going
    staged: Staged = NOT_STAGED  # what the local launcher staged for this process


class QuorumControl:
    """The trainer's control collectives (loss logging, evaluation, the summary) on the live
    quorum, through the engine's membership; every site issues them in the same order."""

    def __init__(self, engine: SyncEngine) -> None:
        self.engine = engine  # its membership runner exists once the block was entered
        self.meter = ByteMeter()  # their bytes are in the engine's meter, counted as control
        self._count, self._step = 0, -1  # control collectives so far at this step

    def all_reduce(self, t: torch.Tensor, control: bool = True) -> torch.Tensor:
        """Sum ``t`` over the live sites, in place (retried on a new quorum if one is lost)."""

        def reduce(transport: Any, _: Any) -> torch.Tensor:
            return transport.all_reduce(t.clone(), control=True)  # t intact if it fails

        # named by the run's step, so a site that joined later names them alike
        step = self.engine.step
        self._count = self._count + 1 if step == self._step else 1
        self._step = step
        tag, runner = f"control@{step}#{self._count}", self.engine.membership
        # on the comm thread, behind the syncs queued there: one order of quorums everywhere
        t.copy_(self.engine.transport.blocking(lambda: runner.run(tag, reduce)))
        return t


def record_membership(
    events: list[dict],
    sites: int,
    steps: int,
    tokens_per_site_step: int,
    out: Path,
    summary: RunSummary,
    starting: int = 0,
) -> None:
    """The run's membership events into the summary and DIR/membership.jsonl; goodput and the
    tokens actually trained (a lost site's steps count up to its last sync that stood; an added
    site's from the sync it joined at). ``starting``: the sites the run began with (0: all)."""
    useful = 0
    for s in range(sites):
        # the step from which site s is in the run (None: out, or not added yet)
        since: int | None = 0 if s < (starting or sites) else None
        for e in events:
            if s in e["left"] and since is not None:  # its steps after its last sync are lost
                useful, since = useful + e["last_step"] - since, None
            if s in e.get("joined", []) and since is None:
                since = int(e["at"].partition("@")[2])
        useful += steps - since if since is not None else 0
    # torchft's DiLoCo throws a failed round away on every member; lowcomm's never does
    useful -= sum(e.get("discarded_steps", 0) * len(e["members"]) for e in events)
    summary.tokens = useful * tokens_per_site_step
    summary.extra["membership"] = events
    wall = summary.wall_s or 0.0
    summary.extra["goodput"] = summary.tokens / wall if wall > 0 else 0.0
    with open(out / "membership.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


#: a process's place in its run: a worker of a fixed world, or a site of an elastic run
Role = FixedWorld | ElasticSite
#: the place of every worker of a fixed world
FIXED_WORLD = FixedWorld()
