"""A user's own training script, run by tests/test_own_loop.py under torchrun.

Not our model and not our trainer: a small network with a nested block list, BatchNorm, a frozen
parameter and tied weights, trained by a plain loop inside ``with sync:``. Usage:
``torchrun --nproc-per-node 2 own_loop_script.py STRATEGY[,STRATEGY...] OUT.pt``. Rank 0 writes
the results; with several strategies (one after the other in the same processes, which saves a
torchrun's start per strategy), OUT names each one's file through ``{strategy}``.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lowcomm

VOCAB, DIM, SEQ, BATCH, H = 48, 16, 6, 8, 6
SETTINGS = {
    "diloco": dict(sync_every=H),
    "streaming": dict(sync_every=H, fragments=3, overlap=1),
    "sparseloco": dict(sync_every=H, density=1 / 8),
    "co2": dict(sync_every=H),
}
PRESETS = {
    "diloco": lowcomm.DiLoCo,
    "streaming": lowcomm.StreamingDiLoCo,
    "sparseloco": lowcomm.SparseLoCo,
    "co2": lowcomm.CO2,
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        return h + torch.relu(self.bn(self.fc(h).reshape(b * t, c)).reshape(b, t, c))


class UserNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.trunk = nn.ModuleDict({"stack": nn.ModuleList(Block() for _ in range(4))})
        self.scale = nn.Parameter(torch.ones(DIM), requires_grad=False)  # frozen
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.trunk["stack"]:
            h = block(h)
        return self.head(h * self.scale)


def build(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(100 + rank)  # different on purpose: lowcomm starts everyone from rank 0
    model = UserNet()
    with torch.no_grad():
        model.scale.fill_(1.0 + rank)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def step(
    model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, skip: bool = False
) -> None:
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    F.cross_entropy(model(x).reshape(-1, VOCAB), ((x * 5 + 3) % VOCAB).reshape(-1)).backward()
    if not skip:  # as a GradScaler does after an overflow on this worker only
        opt.step()
    opt.zero_grad()


def train(
    strategy: str, blocks: list[int], skipped: tuple[int, ...] = ()
) -> dict[str, torch.Tensor]:
    """Train in ``blocks`` (loop iterations per ``with`` block on this rank, optimizer steps
    skipped at the ``skipped`` iterations); the state every rank holds at the end."""
    rank = dist.get_rank()
    model, opt = build(rank)
    gen = torch.Generator().manual_seed(rank)
    sync = PRESETS[strategy](model, opt, timeout_s=30, **SETTINGS[strategy])
    i = 0
    for n in blocks:
        with sync:
            for _ in range(n):
                i += 1
                step(model, opt, gen, skip=i in skipped)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_everywhere(state: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([v.double().reshape(-1) for v in state.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def reference_diloco(steps: int, world: int) -> dict[str, torch.Tensor]:
    """DiLoCo on this model in plain torch: both workers replayed here, buffers averaged at
    every sync, then one more outer step over the partial round and a buffer average."""
    init, _ = build(0)
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    trainable = [n for n, p in init.named_parameters() if p.requires_grad]
    glob = {n: p.detach().clone() for n, p in init.named_parameters() if p.requires_grad}
    outer = torch.optim.SGD(list(glob.values()), lr=0.7, momentum=0.9, nesterov=True)

    def sync_all() -> None:
        params = [dict(m.named_parameters()) for m in models]
        for n in trainable:
            glob[n].grad = torch.stack([glob[n] - p[n].detach() for p in params]).mean(0)
        outer.step()
        average_buffers()
        with torch.no_grad():
            for p in params:
                for n in trainable:
                    p[n].copy_(glob[n])

    def average_buffers() -> None:
        bufs = [dict(m.named_buffers()) for m in models]
        with torch.no_grad():
            for n, b in bufs[0].items():
                if b.is_floating_point():
                    mean = torch.stack([bb[n].float() for bb in bufs]).mean(0)
                    for bb in bufs:
                        bb[n].copy_(mean)

    for t in range(1, steps + 1):
        for m, o, g in zip(models, opts, gens):
            step(m, o, g)
        if t % H == 0:
            sync_all()
    if steps % H:
        sync_all()
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}


def main() -> None:
    strategies, out = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for strategy in strategies:
        contract(strategy, out.format(strategy=strategy))


def contract(strategy: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    one = train(strategy, [40])
    two = train(strategy, [20, 20])
    uneven = train(strategy, [44 if rank == 0 else 41])
    whole_rounds = train(strategy, [36])
    drift = train(strategy, [40], skipped=(9, 10) if rank == 1 else ())  # rank 1 two steps behind
    result = {
        "two_blocks_equal_one": all(torch.equal(one[k], two[k]) for k in one),
        "same_on_every_rank": [same_everywhere(s) for s in (one, two, uneven, whole_rounds, drift)],
        "partial_round_counts": any(not torch.equal(one[k], whole_rounds[k]) for k in one),
        "one": one,
    }
    if strategy == "diloco" and rank == 0:
        result["reference"] = reference_diloco(40, world)
    if rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main()
