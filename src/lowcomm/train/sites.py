"""A worker made of several ranks: the trainer's side of replica groups (FSDP2 inside a site).

With ``ranks_per_worker = N`` the world is R replicas x N ranks, laid out replica-major (ranks
``r*N .. r*N+N-1`` are replica r) on a ("replicate", "shard") device mesh. Inside a replica the
model is sharded with FSDP2 over "shard"; lowcomm's outer loop runs over "replicate" (see
``LowComm(mesh=...)``). The synchronous baseline (strategy ddp) is FSDP2's HSDP: sharded inside
a replica, gradients all-reduced between replicas every step.

Every replica sees the batches a one-rank replica would see; its N ranks each take 1/N of the
rows of every batch, so ``batch_size`` stays "sequences per worker per step".

FSDP2's traffic inside a replica is metered through its custom-collective interface (the
all-gathers and reduce-scatters it issues, ring wire cost); HSDP's all-reduce between replicas
through its all-reduce hook, from the size of what it reduced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ConfigError
from ..schedule import find_blocks
from ..transport import ByteMeter


@dataclass
class Site:
    """Where this rank sits: its replica, its position inside it, and the mesh."""

    replicas: int
    ranks_per_worker: int
    replica: int
    part: int
    mesh: Any = None  # DeviceMesh ("replicate", "shard") when ranks_per_worker > 1

    @property
    def sharded(self) -> bool:
        """True when a replica spans several ranks (FSDP2 inside)."""
        return self.ranks_per_worker > 1


def site_of(rank: int, world: int, ranks_per_worker: int) -> Site:
    """This rank's place in R x N, or one clear error when N does not divide the world."""
    n = ranks_per_worker
    if n < 1 or world % n:
        raise ConfigError(
            f"ranks_per_worker={n} does not divide the {world} ranks: start workers x "
            f"ranks_per_worker processes (torchrun --nnodes R --nproc-per-node N)"
        )
    return Site(world // n, n, rank // n, rank % n)


def build_mesh(site: Site, device: torch.device, replicas: int | None = None) -> None:
    """The ("replicate", "shard") mesh of a multi-rank site (every rank calls this);
    ``replicas``: how many sites the world holds (1: an elastic site's world is its own)."""
    from torch.distributed.device_mesh import init_device_mesh

    site.mesh = init_device_mesh(
        device.type,
        (site.replicas if replicas is None else replicas, site.ranks_per_worker),
        mesh_dim_names=("replicate", "shard"),
    )


def shard_model(
    model: nn.Module, site: Site, hsdp: bool, meter: ByteMeter, between: ByteMeter
) -> None:
    """FSDP2 over each repeated block and the root: over "shard" (outer-loop strategies) or
    the whole 2-D mesh (HSDP, the synchronous baseline). Collectives inside a worker are
    metered into ``meter``, HSDP's all-reduce between workers into ``between``."""
    from torch.distributed.fsdp import fully_shard

    mesh = site.mesh if hsdp else site.mesh["shard"]
    units = [model.get_submodule(name) for name in find_blocks(model)] + [model]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        _meter(unit, meter, between, site.ranks_per_worker, site.replicas if hsdp else 1)


def _meter(unit: Any, meter: ByteMeter, between: ByteMeter, n: int, replicas: int) -> None:
    if not hasattr(unit, "set_custom_all_gather"):  # older torch: FSDP2 traffic not metered
        return
    unit.set_custom_all_gather(_MeteredAllGather(meter, n))
    reduce_scatter = _MeteredReduceScatter(meter, n)
    unit.set_custom_reduce_scatter(reduce_scatter)
    if replicas > 1:

        def record(reduced: torch.Tensor) -> None:
            # FSDP2 all-reduces between workers right after its reduce-scatter returns and calls
            # this once it is done: that stretch is time waiting on the link between workers
            between.add_blocked(time.perf_counter() - reduce_scatter.ended)
            nbytes = reduced.numel() * reduced.element_size()
            wire = 2 * (replicas - 1) / replicas * nbytes
            between.record(nbytes, wire, wire, False)

        unit.set_all_reduce_hook(record)


# torch 2.13 renamed these (the old names warn); older versions have only the old names
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _Alloc:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer for one collective (FSDP2's default)."""
        return torch.empty(*size, dtype=dtype, device=device)


class _MeteredAllGather(_Alloc):
    """FSDP2's all-gather, counted at the ring's wire cost: (N - 1)/N of the gathered bytes."""

    def __init__(self, meter: ByteMeter, n: int) -> None:
        self.meter, self.n = meter, n

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op=False
    ) -> Any:
        """Gather, and count it (FSDP2 calls this with these keyword names)."""
        out, inp = output_tensor, input_tensor
        wire = (self.n - 1) / self.n * out.numel() * out.element_size()
        self.meter.record(inp.numel() * inp.element_size(), wire, wire, False)
        return _ALL_GATHER(out, inp, group=group, async_op=async_op)


class _MeteredReduceScatter(_Alloc):
    """FSDP2's reduce-scatter, counted at the ring's wire cost: (N - 1)/N of the input bytes."""

    def __init__(self, meter: ByteMeter, n: int) -> None:
        self.meter, self.n = meter, n
        self.ended = time.perf_counter()  # when the last call returned (see _meter)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        """Reduce-scatter, and count it (FSDP2 calls this with these keyword names)."""
        nbytes = input_tensor.numel() * input_tensor.element_size()
        wire = (self.n - 1) / self.n * nbytes
        self.meter.record(nbytes, wire, wire, False)
        work = _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.ended = time.perf_counter()
        return work


def rows_of(x: torch.Tensor, site: Site) -> torch.Tensor:
    """This rank's rows of its replica's batch."""
    if not site.sharded:
        return x
    per = x.shape[0] // site.ranks_per_worker
    return x[site.part * per : (site.part + 1) * per]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU: sharded tensors gathered (a collective: every rank)."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out
