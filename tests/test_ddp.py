"""The ddp baseline: M workers with the metered FP32 hook equal one process on the M x batch."""

from __future__ import annotations

import pytest
import torch
from helpers import adamw, batches, flat_params, tiny_model
from torch.nn.parallel import DistributedDataParallel as DDP

import lowcomm
from lowcomm.transport import Transport

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
    return {
        "params": flat_params(model),
        "meter": transport.meter.as_dict(),
        "numel": flat_params(model).numel(),
    }


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


def _torch_hook_worker(rank: int, world: int, kind: str, bucket_cap_mb: float = 25.0) -> dict:
    import torch.distributed as dist

    model = tiny_model(seed=0)
    opt = adamw(model)
    transport = Transport(dist.new_group(backend="gloo"))
    ddp = DDP(model, process_group=transport.group, bucket_cap_mb=bucket_cap_mb)
    from lowcomm.lab.ddp_hooks import TorchHookState, torch_hook

    state = TorchHookState(transport, kind, rank=1, start_iter=2)
    ddp.register_comm_hook(state, torch_hook)
    data = batches(rank, world)
    per_step = []
    for _ in range(STEPS):
        before = transport.meter.payload_bytes
        x, y = data.next()
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(transport.meter.payload_bytes - before)
    return {
        "params": flat_params(model),
        "per_step": per_step,
        "numel": flat_params(model).numel(),
        "buckets": state.buckets,
    }


@pytest.mark.slow  # 7 s, by hand (pytest -m slow): the default suite stays under 10 minutes
def test_bf16_hook_is_metered_at_half_the_bytes_and_tracks_fp32(workers):
    res = workers(_torch_hook_worker, 2, "bf16")
    ref = workers(_ddp_worker, 2)
    n = res[0]["numel"]
    assert res[0]["per_step"] == [2 * n] * STEPS  # bf16 on the wire: 2 bytes per gradient entry
    assert torch.equal(res[0]["params"], res[1]["params"])
    diff = (res[0]["params"] - ref[0]["params"]).abs().max().item()
    assert 0 < diff < 1e-2  # the hook really rounded, and stayed close to the FP32 run


def test_powersgd_hook_compresses_after_its_start_steps(workers):
    res = workers(_torch_hook_worker, 2, "powersgd")
    n = res[0]["numel"]
    per_step = res[0]["per_step"]
    assert per_step[:2] == [4 * n, 4 * n]  # PyTorch's PowerSGD all-reduces plain FP32 at first
    assert all(0 < b < n for b in per_step[2:])  # rank 1: far below 4 bytes per entry
    assert torch.equal(res[0]["params"], res[1]["params"])


@pytest.mark.slow  # by hand (pytest -m slow): the default suite stays under 10 minutes
def test_powersgd_hook_keeps_collective_order_across_many_buckets(workers):
    """PowerSGD's callback all-reduces of several buckets in flight must not interleave
    (gloo aborts)."""
    res = workers(_torch_hook_worker, 2, "powersgd", 0.002)
    assert res[0]["buckets"] >= 3 * STEPS  # really several buckets per step
    assert torch.equal(res[0]["params"], res[1]["params"])
    assert all(0 < b < res[0]["numel"] for b in res[0]["per_step"][2:])
