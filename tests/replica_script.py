"""A worker that is a whole site: run by tests/test_replicas.py under torchrun.

    torchrun --nproc-per-node 4 replica_script.py fsdp OUT   # 2 replicas x 2 ranks, FSDP2 inside
    torchrun --nproc-per-node 4 replica_script.py ddp OUT    # 2 replicas x 2 ranks, DDP inside
    torchrun --nproc-per-node 2 replica_script.py plain OUT  # 2 replicas x 1 rank, same data
    torchrun --nproc-per-node 2 replica_script.py split OUT  # as plain, each weight in 2 halves
    torchrun --nproc-per-node 2 replica_script.py plain,split OUT  # both, one after the other

Every strategy trains the same model from the same start on the same per-replica batches; each
rank saves the full final model (gathered from its shards) and its byte counts to
OUT/MODE/rank{r}.pt.
In the FSDP run a replica's batch is split between its two ranks (FSDP2 averages their
gradients, which equals the whole batch's mean gradient).

The split model holds each weight as two parameters, its first and second half of rows: the
layout the FSDP run's shards have. A codec that looks at a whole tensor (top-k tiles, a value
table per tensor) sees the same halves there, so it is the exact reference for those codecs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lowcomm
from lowcomm.transport import shutdown

# 12 steps: two syncs of every strategy (H = 6), each fragment of streaming's synced twice;
# what the tests check (shard = whole, half the bytes) does not grow with the steps
DIM, BLOCKS, STEPS, BATCH = 32, 4, 12, 8
STRATEGIES = {
    "diloco": lambda m, o: lowcomm.DiLoCo(m, o, sync_every=6, **MESH),
    "streaming": lambda m, o: lowcomm.StreamingDiLoCo(m, o, sync_every=6, fragments=2, **MESH),
    "streaming_fp32": lambda m, o: lowcomm.StreamingDiLoCo(
        m, o, sync_every=6, fragments=2, codec="fp32", **MESH
    ),
    "sparseloco": lambda m, o: lowcomm.SparseLoCo(m, o, sync_every=6, **MESH),
    "co2": lambda m, o: lowcomm.CO2(m, o, sync_every=6, **MESH),
}
MESH: dict = {}


class SplitLinear(nn.Module):
    """A bias-free linear layer whose weight is two parameters: rows [0, n/2) and [n/2, n)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        half = weight.shape[0] // 2
        self.w0 = nn.Parameter(weight[:half].clone())
        self.w1 = nn.Parameter(weight[half:].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, torch.cat([self.w0, self.w1]))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def split(model: Net) -> Net:
    for holder in [model, *model.blocks]:
        for name, child in list(holder.named_children()):
            if isinstance(child, nn.Linear):
                setattr(holder, name, SplitLinear(child.weight.detach()))
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, named as in Net (shards gathered, split halves joined)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        name = name.removeprefix("module.")  # DDP's wrapper
        if name.endswith(".w1"):
            continue
        if name.endswith(".w0"):
            other = dict(model.named_parameters())[name[:-1] + "1"].detach()  # not under DDP
            name, t = name[:-3] + ".weight", torch.cat([t, other])
        out[name] = t.detach().clone()
    return out


def build(mode: str, replicas: int, ranks_per_replica: int) -> Net:
    torch.manual_seed(0)  # the same start everywhere (rank 0's is broadcast anyway)
    model = Net()
    if mode == "split":
        return split(model)
    if mode in ("fsdp", "ddp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(
            "cpu", (replicas, ranks_per_replica), mesh_dim_names=("replicate", "shard")
        )
        MESH["mesh"] = mesh
        if mode == "ddp":  # the worker's ranks hold whole copies, DDP averages their gradients
            return nn.parallel.DistributedDataParallel(
                model, process_group=mesh["shard"].get_group()
            )
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    return model


def batches(replica: int, part: int, parts: int):
    """The replica's batches, this rank's rows of each (the same stream in every mode)."""
    g = torch.Generator().manual_seed(1000 + replica)
    target = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7)) / DIM**0.5
    rows = BATCH // parts
    for _ in range(STEPS):
        x = torch.randn(BATCH, DIM, generator=g)
        x = x[part * rows : (part + 1) * rows]
        yield x, x @ target


def main(modes: str, out: Path) -> None:
    dist.init_process_group("gloo")
    for mode in modes.split(","):  # modes of the same world size, in one torchrun
        run(mode, out / mode)
    shutdown()


def run(mode: str, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks_per_replica = 2 if mode in ("fsdp", "ddp") else 1
    replicas = world // ranks_per_replica
    replica, part = divmod(rank, ranks_per_replica)
    result: dict = {}
    for strategy, make in STRATEGIES.items():
        model = build(mode, replicas, ranks_per_replica)
        result.setdefault("start", full_state(model))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sync = make(model, opt)
        with sync:
            for x, y in batches(replica, part, ranks_per_replica):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        result[strategy] = {
            "model": full_state(model),
            "payload_bytes": sync.stats.payload_bytes,
            "bytes_sent": sync.stats.bytes_sent,
            "inner_bytes_sent": sync.stats.extra.get("inner_bytes_sent", 0),
        }
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
