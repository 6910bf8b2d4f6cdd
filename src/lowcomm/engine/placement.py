"""Where a worker sits: its outer process group (or mesh position), the parts of each weight
its ranks sync with DDP inside a worker, and the broadcasts that keep a worker one model.

A *worker* may be a whole site: a 2-D DeviceMesh ("replicate", "shard") puts several ranks in
it. Each rank then syncs its own shard (FSDP2) or slice of rows (DDP) with the ranks at the same
position in the other workers; with DDP the slices are shared inside the worker after a sync.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _buffers
from ..config import ConfigError
from ..elastic import Elastic, Membership, View
from ..elastic.site import SiteRanks
from ..transport import Transport, shutdown_at_exit
from .fragment import Fragment
from .tensors import DTensor, Part, local, views

NO_GROUP_MESSAGE = (
    "lowcomm needs a torch.distributed process group: call "
    "torch.distributed.init_process_group('gloo') (or 'nccl' on GPUs) before entering the block; "
    "torchrun only sets the environment it reads"
)


class Placement:
    """This rank's groups and, with DDP inside a worker, the part of every weight it syncs."""

    def __init__(
        self,
        model: nn.Module,
        process_group: dist.ProcessGroup | None,
        mesh: Any,
        timeout_s: float,
        elastic: Elastic | None = None,
    ) -> None:
        check_mesh(mesh, process_group)
        if elastic is not None and not isinstance(elastic, Elastic):
            raise ConfigError(f"elastic must be a lowcomm.Elastic, got {type(elastic).__name__}")
        if elastic is not None:
            check_site_mesh(mesh, process_group)
        self.elastic = elastic
        self.membership: Membership | None = None
        self.start_members: list[int] = []  # the sites of the first quorum
        self.start_view: Any = None  # ... as this site saw it (its members' stores)
        self.admission: tuple[View, str] | None = None  # a joiner: the view and sync that took it
        self.model = model
        self.process_group = process_group
        self.mesh = mesh
        self.timeout_s = timeout_s
        self.part: Part | None = None  # DDP inside a worker: (this rank's part, parts)
        self.inner: Transport | None = None  # the ranks of this worker, to share the parts
        # elastic with mesh=: the site's ranks (each syncs its shard with the same rank of
        # the other sites; rank 0 talks to the lighthouse for all: see elastic.site)
        self.site_ranks = site_ranks(mesh) if elastic is not None and mesh is not None else []

    def join(self, fingerprint: str = "") -> dist.ProcessGroup:
        """The outer group this rank syncs on (created here unless given); with membership,
        the group of the first quorum that holds every starting site, or, for a site joining
        a running run, of the quorum that admits it (``fingerprint``: the run's settings)."""
        if self.elastic is not None:
            self.membership = Membership(self.elastic, fingerprint, self._site())
            admitted = None
            if self.elastic.join:
                admitted = self.membership.join()
            elif self.elastic.enter:  # launched on its own: the lighthouse says start or join
                from ..elastic.enter import enter

                admitted = enter(self.membership)
            if admitted is not None:
                self.admission = admitted
                view = admitted[0]
            else:
                view = self.membership.start()
            self.start_members, self.start_view = view.members, view
            return self.membership.group(view, self.membership.generation)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(NO_GROUP_MESSAGE)
        shutdown_at_exit()
        if self.process_group is not None:
            return self.process_group
        if self.mesh is not None:
            return self._join_mesh()
        # A group of its own, so engine traffic (possibly on the comm thread) never
        # interleaves with the training loop's own collectives on the default group.
        return dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=self.timeout_s))

    def _site(self) -> SiteRanks | None:
        """A site of several ranks (elastic with mesh=): its groups, and with DDP inside it
        this rank's part of every weight (None: a site of one process)."""
        if len(self.site_ranks) < 2:
            return None
        e = self.elastic
        assert e is not None
        if e.rounds == "quorum":
            raise ConfigError(QUORUM_SITE_RANKS)
        # a rank waits at its site's vote for the slowest rank's collectives and group
        site = SiteRanks(self.site_ranks, 2 * e.timeout_s + e.connect_s)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not any(isinstance(p, DTensor) for p in params):
            check_replicated(self.model, site.size)
            inner = dist.new_group(self.site_ranks, timeout=timedelta(seconds=self.timeout_s))
            self.part, self.inner = (site.rank, site.size), Transport(inner)
        return site

    def _join_mesh(self) -> dist.ProcessGroup:
        """The outer group of this rank's position; with DDP inside a worker, also the part
        of every parameter this rank syncs and the worker's own group to share the parts."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        outer, inner = replica_groups(self.mesh, self.timeout_s)
        n = dist.get_world_size(inner)
        if n > 1 and not any(isinstance(p, DTensor) for p in params):
            check_replicated(self.model, n)
            self.part = (dist.get_rank(inner), n)
            self.inner = Transport(inner)
        return outer

    def runner(self, transport: Transport, buffers: Transport, transports: Any, hooks: Any) -> Any:
        """With membership, what runs each sync on the live quorum (None without); its
        quorums' transports come from ``transports`` (the engine's factory), and ``hooks``
        (the engine's :class:`~lowcomm.protocols.SyncHooks`) may change its commit votes."""
        if self.membership is None:
            return None
        from ..elastic import Runner

        runner = Runner(self.membership, transport.meter, buffers.meter, transports, hooks)
        runner.record.members = list(self.start_members)  # a site lost before the first sync counts
        if runner.rounds is not None:  # whom to tell of its arrivals at the first sync
            runner.rounds.expect(self.start_view, "start")
        return runner

    def share_parts(self, frags: list[Fragment]) -> None:
        """DDP inside a worker: each rank wrote only its part of these fragments' parameters;
        every part is broadcast from its rank to the worker's other ranks (a fast local link)."""
        if self.part is None:
            return
        assert self.inner is not None
        n = self.part[1]
        with torch.no_grad():
            for f in frags:
                for owner in range(n):
                    pieces = [local(p, (owner, n)) for p in f.raw]
                    flat = torch.cat([x.reshape(-1) for x in pieces])
                    self.inner.broadcast(flat, src=owner, control=False)
                    for x, v in zip(pieces, views(flat, pieces)):
                        x.copy_(v)

    def broadcast_constants(self, transport: Transport, buffers: str, floating: bool) -> None:
        """Frozen parameters and integer buffers (floating ones too if asked) from rank 0."""
        tensors = [p for p in self.model.parameters() if not p.requires_grad]
        if buffers != "local":
            tensors += _buffers.persistent(self.model, floating=None if floating else False)
        with torch.no_grad():
            for t in tensors:
                transport.broadcast(local(t).data, src=0, control=True)


def check_mesh(mesh: Any, process_group: Any) -> None:
    """A DeviceMesh whose workers lie along a "replicate" dimension, or one clear error."""
    if mesh is None:
        return
    if process_group is not None:
        raise ConfigError("give either mesh= or process_group=, not both")
    names = getattr(mesh, "mesh_dim_names", None)
    if not hasattr(mesh, "mesh") or (mesh.ndim > 1 and "replicate" not in (names or ())):
        raise ConfigError(
            "mesh must be a torch DeviceMesh whose workers lie along a dimension named "
            "'replicate', e.g. init_device_mesh('cpu', (workers, ranks_per_worker), "
            "mesh_dim_names=('replicate', 'shard'))"
        )


# why two-phase stays out of elastic runs (said by the engine and the CLI alike)
QUORUM_SITE_RANKS = (
    "rounds=quorum with several ranks per site is not built: use rounds=lockstep, or one rank "
    "per site"
)
TWO_PHASE_ELASTIC = (
    "reduce=two-phase is not elastic: its payload is cut into one shard per member of the run's "
    "starting size and each owner re-encodes its shard with compensation state of its own, so "
    "a change of members would have to re-encode (a retry resends the same bytes) and move "
    "that state: use reduce=gather (or auto)"
)


# why evict stays out of sites of several ranks (said by the engine and the CLI alike)
EVICT_SITE_RANKS = (
    "evict=true with several ranks per site is not built (each rank judges only its own shard, "
    "and they could differ): drop evict, offenders are still named"
)


def check_elastic_config(config: Any, elastic: Elastic | None, mesh: Any) -> None:
    """Sync settings an elastic run cannot have, refused when the engine is made."""
    if elastic is not None and config.resolved_reduce == "two-phase":
        raise ConfigError(TWO_PHASE_ELASTIC)
    if elastic is not None and mesh is not None and config.evict:
        raise ConfigError(EVICT_SITE_RANKS)


def check_site_mesh(mesh: Any, process_group: Any) -> None:
    """With elastic=, mesh= is the site's own ranks (FSDP2 or DDP inside it): a 1-D mesh, or
    2-D with a "replicate" dimension of 1 (the membership decides which sites sync)."""
    if process_group is not None:
        raise ConfigError(
            "elastic= decides the group between sites itself: give no process_group= (mesh= "
            "names a site's own ranks)"
        )
    if mesh is not None and mesh.ndim > 1 and workers_of(mesh) != 1:
        raise ConfigError(
            f"with elastic=, mesh= is this site's own ranks (a site is one member of the run), "
            f"but its 'replicate' dimension holds {workers_of(mesh)} workers: give the site's "
            f"mesh, e.g. init_device_mesh('cpu', (ranks,), mesh_dim_names=('shard',))"
        )
    if mesh is None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world > 1:
            raise ConfigError(
                f"elastic= in a process group of {world} ranks without mesh=: a site of several "
                f"ranks gives its mesh (init_device_mesh('cpu', ({world},), "
                f"mesh_dim_names=('shard',))) so they act as one member; one process per site "
                f"needs no process group"
            )


def site_ranks(mesh: Any) -> list[int]:
    """The global ranks of a site's mesh, in order (rank 0 of them talks for the site)."""
    return [int(r) for r in mesh.mesh.reshape(-1).tolist()]


def check_replicated(model: nn.Module, per_worker: int) -> None:
    """Several ranks per worker with unsharded weights must be DDP inside the worker."""
    if not any(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise ConfigError(
            f"mesh= puts {per_worker} ranks in each worker but the model is neither sharded "
            f"with FSDP2 (fully_shard(model, mesh=mesh['shard'])) nor wrapped in "
            f"DistributedDataParallel over the worker's ranks: wrap it, and pass the wrapped "
            f"model, or give one rank per worker"
        )


def workers_of(mesh: Any) -> int:
    """How many workers a mesh holds: the size of its "replicate" dimension."""
    if mesh.ndim == 1:
        return mesh.size()
    return mesh.size(mesh.mesh_dim_names.index("replicate"))


def replica_groups(mesh: Any, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's outer group (the ranks at its own position in every worker) and its
    worker's group (the ranks of its worker).

    Groups of our own (every rank creates all of them, in one order), so engine traffic never
    interleaves with the user's own collectives on the mesh's groups.
    """
    ranks = mesh.mesh
    if ranks.ndim > 1:
        ranks = ranks.movedim(mesh.mesh_dim_names.index("replicate"), 0)
    ranks = ranks.reshape(ranks.shape[0], -1)  # [worker, position]
    kw = {"backend": dist.get_backend(), "timeout": timedelta(seconds=timeout_s)}
    outer, _ = dist.new_subgroups_by_enumeration([c.tolist() for c in ranks.T], **kw)
    inner, _ = dist.new_subgroups_by_enumeration([r.tolist() for r in ranks], **kw)
    return outer, inner
