"""The ddp baseline: M workers with the metered FP32 hook equal one process on the M x batch."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lowcomm
from lowcomm.transport import Transport
from helpers import adamw, batches, flat_params, tiny_model

STEPS = 6


def _ddp_worker(rank: int, world: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    transport = Transport()
    ddp = DDP(model)
    ddp.register_comm_hook(lowcomm.GradReduceState(transport), lowcomm.allreduce_hook)
    data = batches(rank, world)
    for _ in range(STEPS):
        x, y = data.next()
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {"params": flat_params(model), "meter": transport.meter.as_dict(),
            "numel": flat_params(model).numel()}


def test_ddp_equals_single_process_on_the_big_batch(workers):
    world = 2
    res = workers(_ddp_worker, world)
    torch.set_num_threads(1)
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = [batches(r, world) for r in range(world)]
    for _ in range(STEPS):
        xs, ys = zip(*(d.next() for d in data))
        model(torch.cat(xs), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for r in res:
        torch.testing.assert_close(r["params"], flat_params(model), atol=1e-5, rtol=1e-5)
    assert torch.equal(res[0]["params"], res[1]["params"])
    # every gradient element crosses the ring once per step: 2(M-1)/M x 4 bytes x params
    n = res[0]["numel"]
    assert res[0]["meter"]["payload_bytes"] == STEPS * 4 * n
    assert res[0]["meter"]["sent_bytes"] == round(STEPS * 2 * (world - 1) / world * 4 * n)
