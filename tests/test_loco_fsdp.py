"""LoCo as FSDP2's compressed reduce-scatter, on CPU/gloo where this torch supports it."""

from __future__ import annotations

import pytest
import torch

from lowcomm.hooks import loco_fsdp as loco

pytestmark = pytest.mark.skipif(
    loco._FSDPModule is None, reason="torch without FSDP2 set_custom_reduce_scatter"
)

REPEATS = 12


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))


def _fsdp_worker(rank: int, world: int, beta: float, quantizer: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = _model()
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    installed = loco.enable_fsdp_loco(m, beta=beta, group_size=32, quantizer=quantizer)
    torch.manual_seed(100 + rank)
    x = torch.randn(16, 64)
    grads = []
    for _ in range(REPEATS):  # the same batch each time: only the compensation changes
        m(x).pow(2).mean().backward()
        grads.append({n: p.grad.full_tensor().clone() for n, p in m.named_parameters()})
        m.zero_grad()
    sent = sum(t.meter.sent_bytes for rs in installed.values() for t in rs._transports.values())
    comps = [rs.compensation for rs in installed.values() if rs.compensation.keys()]  # (root: none)
    devices = {b.device.type for c in comps for b in c._store.buffers.values()}
    return {
        "grads": grads,
        "names": list(installed),
        "bytes": sent,
        "devices": devices,
        "steps": {c.steps for c in comps},
        "reset_every": {c.reset_every for c in comps},
    }


def _true_mean(world: int) -> dict:
    grads = []
    for rank in range(world):
        m = _model()
        torch.manual_seed(100 + rank)
        x = torch.randn(16, 64)
        m(x).pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    return {n: sum(g[n] for g in grads) / world for n in grads[0]}


@pytest.mark.parametrize("world,quantizer", [(2, "ours"), (3, "authors")])
def test_fsdp_loco_reduce_scatter(workers, world, quantizer):
    # beta = 0: plain error feedback, whose error telescopes; at M = 3 FSDP pads the 32-row
    # layer's shards, which the FP32 path of the biases must see through
    res = workers(_fsdp_worker, world, 0.0, quantizer)
    torch.set_num_threads(1)
    true = _true_mean(world)
    assert len(res[0]["names"]) == 3 and res[0]["bytes"] > 0  # our reduce-scatter really ran
    # one reduce-scatter per module per step: steps counted, the authors' reset period, and
    # the buffers where the gradients are
    assert res[0]["steps"] == {REPEATS} and res[0]["reset_every"] == {1024}  # the 2 layers
    assert res[0]["devices"] == {"cpu"}
    for n, t in true.items():
        first = res[0]["grads"][0][n]
        scale = t.abs().max()
        if n.endswith("weight"):
            assert (first - t).abs().max() > 0, n  # ... and really quantized
        else:  # biases: 1-D, reduce-scattered in FP32
            torch.testing.assert_close(first, t, rtol=1e-5, atol=1e-7)
        # one step: within the 4-bit bound of the true FP32 mean (absmax/7 per group, 2 workers;
        # absmax/8 with the top clipped is as tight)
        assert (first - t).abs().max() <= scale / 7 + 1e-6, n
        # error feedback: the average of what was sent converges to the true mean as 1/K
        avg = torch.stack([g[n] for g in res[0]["grads"]]).mean(0)
        assert (avg - t).abs().max() < (first - t).abs().max() / 3 + 1e-7, n
        assert torch.equal(res[0]["grads"][-1][n], res[1]["grads"][-1][n])
