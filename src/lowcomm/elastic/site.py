"""A site of several ranks as one member of the run: the site's rank 0 talks to the lighthouse
and hands every answer to the site's other ranks over the site's own group; its vote on a sync
is "ok" only if every rank of the site completed it.

Every rank of a site runs the same membership steps in the same order (the same views reach
all of them, so the runner's choices are the same everywhere); only the lighthouse requests
happen on rank 0 alone (:meth:`SiteRanks.lead`). Each rank then syncs its own shard with the
same rank of the other sites, on a group of its own per quorum (see ``Membership.group``).

Two groups of the site's ranks (gloo, on the CPU, whatever the accelerator):
- ``lead``: the answers of rank 0; a follower may wait there as long as rank 0 waits for the
  lighthouse (a joiner waits for the run's next sync), so its timeout is long. A site whose
  rank 0 dies is torn down by its launcher (torchrun), so nothing waits on a dead leader.
- ``vote``: the ranks' own outcomes, gathered before rank 0 votes. Bounded: a rank that does not
  reach the vote within ``wait_s`` (hung) makes the whole site leave, as a dead one does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import MembershipError
from ..transport import Transport

T = TypeVar("T")
_LEAD_TIMEOUT = timedelta(days=7)  # a follower waits on rank 0 as long as rank 0 waits


class SiteRanks:
    """The ranks of this site (global ranks of the process group), and this rank's place."""

    def __init__(self, ranks: list[int], wait_s: float) -> None:
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())  # this rank's position in its site
        self.wait_s = wait_s
        # every rank of the world calls new_group for each group, in one order
        self._lead = dist.new_group(self.ranks, backend="gloo", timeout=_LEAD_TIMEOUT)
        self._vote = dist.new_group(self.ranks, backend="gloo", timeout=timedelta(seconds=wait_s))
        self._leads_t, self._votes_t = Transport(self._lead), Transport(self._vote)
        self._leading = False

    @property
    def leads(self) -> bool:
        """Whether this rank talks to the lighthouse for its site (the site's rank 0)."""
        return self.rank == 0

    def lead(self, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0, its result (or its MembershipError, ConfigError or other
        exception, raised again) on every rank of the site. Nested calls run ``fn`` at once."""
        if self._leading:
            return fn()
        box: list[Any] = [None]
        if self.leads:
            self._leading = True
            try:
                box[0] = ("ok", fn())
            except Exception as err:  # every rank raises it alike
                box[0] = ("err", err)
            finally:
                self._leading = False
        kind, value = self._leads_t.broadcast_object(box[0], src=0)
        if kind == "err":
            raise value
        return value

    def vote(
        self, ok: bool, blame: tuple[int, str] | None, unreached: list[int]
    ) -> tuple[bool, tuple[int, str] | None, list[int]]:
        """The site's vote from every rank's: ok if all are, the first accusation, every
        member some rank could not reach. Raises MembershipError (the site leaves) when a rank
        does not reach the vote within ``wait_s``."""
        mine = [ok, blame, sorted(unreached)]
        try:
            everyone = self._votes_t.all_gather_object(mine)
        except RuntimeError as err:
            raise MembershipError(
                f"a rank of this site did not reach its vote within {self.wait_s:g} s "
                f"({str(err).splitlines()[0][:120]}): the whole site leaves the run"
            ) from None
        blames = [b for _, b, _ in everyone if b is not None]
        reached = sorted({s for _, _, u in everyone for s in u})
        return all(o for o, _, _ in everyone), (tuple(blames[0]) if blames else None), reached

    def worst(self, code: int) -> int:
        """The highest of the site's ranks' ``code`` (every rank learns it)."""
        t = torch.tensor([code], dtype=torch.int64)
        self._votes_t.all_reduce(t, control=True, op="max")
        return int(t.item())
