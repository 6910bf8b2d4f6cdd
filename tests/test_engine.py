"""The engine on real gloo workers against an independent plain-torch computation."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import adamw, batches, flat_params, local_steps, tiny_model

import lowcomm


def _diloco_worker(rank: int, world: int, H: int, rounds: int, lr: float, mom: float) -> dict:
    model = tiny_model(seed=100 + rank)  # deliberately different: the engine starts all from rank 0
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.DiLoCo(model, opt, sync_every=H, outer_lr=lr, outer_momentum=mom)
    globals_after = []
    with sync:
        for step in range(1, H * rounds + 1):
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if step % H == 0:
                globals_after.append(sync.global_flat().clone())
    return {
        "globals": globals_after,
        "final": flat_params(model),
        "stats": sync.stats.as_dict(),
        "numel": flat_params(model).numel(),
    }


def reference_diloco(world: int, H: int, rounds: int, lr: float, mom: float) -> list[torch.Tensor]:
    """docs/algorithms.md §1 in plain torch: M model copies trained in turn,
    torch.optim.SGD outside."""
    init = tiny_model(seed=100)
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [adamw(m) for m in models]
    data = [batches(r, world) for r in range(world)]
    global_params = [p.detach().clone() for p in init.parameters()]
    outer = torch.optim.SGD(global_params, lr=lr, momentum=mom, nesterov=True)
    out = []
    for _ in range(rounds):
        for m, o, d in zip(models, opts, data):
            local_steps(m, o, d, H)
        for i, g in enumerate(global_params):
            deltas = [g - list(m.parameters())[i].detach() for m in models]
            g.grad = torch.stack(deltas).mean(0)
        outer.step()
        for m in models:
            with torch.no_grad():
                for p, g in zip(m.parameters(), global_params):
                    p.copy_(g)
        out.append(torch.cat([g.detach().reshape(-1) for g in global_params]))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: by hand
def test_diloco_matches_plain_torch(workers, world):
    H, rounds, lr, mom = 4, 3, 0.7, 0.9
    results = workers(_diloco_worker, world, H, rounds, lr, mom)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = reference_diloco(world, H, rounds, lr, mom)
    finally:
        torch.set_num_threads(threads)
    for r, res in enumerate(results):
        assert len(res["globals"]) == rounds
        for k in range(rounds):
            torch.testing.assert_close(
                res["globals"][k],
                expected[k],
                atol=1e-6,
                rtol=0,
                msg=f"rank {r}, outer step {k + 1}",
            )
        # after the last sync every worker holds the global parameters
        torch.testing.assert_close(res["final"], expected[-1], atol=1e-6, rtol=0)
    # the global copy is bit-identical on every worker after every sync
    for k in range(rounds):
        for res in results[1:]:
            assert torch.equal(res["globals"][k], results[0]["globals"][k])
    # bytes: one FP32 ring all-reduce of the whole model (+ the 1-element validity flag) per sync
    st, n = results[0]["stats"], results[0]["numel"]
    assert st["syncs"] == rounds
    assert st["payload_bytes"] == rounds * 4 * (n + 1)
    assert st["bytes_sent"] == rounds * round(2 * (world - 1) / world * 4 * (n + 1))
    assert st["control_bytes_sent"] > 0  # the start-up broadcast is counted apart


def _outer_moves_worker(rank: int, world: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    before = flat_params(model)
    with lowcomm.DiLoCo(model, opt, sync_every=3, outer_lr=1.0, outer_momentum=0.0, nesterov=False):
        for _ in range(3):
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
    return {"before": before, "after": flat_params(model)}


def test_outer_sgd_lr1_no_momentum_is_model_averaging(workers):
    """With lr 1 and no momentum, the outer step lands exactly on the mean of the workers."""
    res = workers(_outer_moves_worker, 2)
    torch.set_num_threads(1)
    locals_ = []
    for r in range(2):
        m = tiny_model(seed=0)
        local_steps(m, adamw(m), batches(r, 2), 3)
        locals_.append(flat_params(m))
    torch.testing.assert_close(res[0]["after"], (locals_[0] + locals_[1]) / 2, atol=1e-6, rtol=0)


def _uneven_worker(rank: int, world: int, strategy: str) -> dict:
    """Model averaging (H = 2) where worker 1 stops after 7 steps, one step into a round."""
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    cfg = lowcomm.preset_config(strategy, workers=world, sync_every=2, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False)  # fmt: skip
    locals_, globals_ = [None], [None]  # per step; locals before that step's sync
    # registered first, so it runs before the engine's hook (which syncs)
    opt.register_step_post_hook(lambda *_: locals_.append(flat_params(model)))
    with (sync := lowcomm.LowComm(model, opt, cfg)):
        for _ in range(10 if rank == 0 else 7):
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            globals_.append(sync.global_flat().clone())
    return {"locals": locals_, "globals": globals_}


def test_a_worker_that_stops_mid_round_is_counted_in_its_last_average(workers):
    """Worker 1's last step (7) is averaged at the next sync (8) with worker 0's: over two
    workers, not one, though its control flags went out before it encoded."""
    res = workers(_uneven_worker, 2, "diloco")
    expected = (res[0]["locals"][8] + res[1]["locals"][7]) / 2
    torch.testing.assert_close(res[0]["globals"][8], expected, atol=1e-6, rtol=0)
    # at 10 worker 1 has nothing left to send: the global copy is worker 0's alone
    torch.testing.assert_close(res[0]["globals"][10], res[0]["locals"][10], atol=1e-6, rtol=0)


def test_unknown_option_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(lowcomm.ConfigError, match="unknown sync option"):
        lowcomm.LowComm(model, adamw(model), sync_evry=3)
    with pytest.raises(lowcomm.ConfigError, match="sync_every"):
        lowcomm.DiLoCo(model, adamw(model), sync_every=0)


def test_engine_needs_distributed():
    model = tiny_model()
    sync = lowcomm.DiLoCo(model, adamw(model), sync_every=2)
    with pytest.raises(lowcomm.ConfigError, match="init_process_group"):
        sync.start()
