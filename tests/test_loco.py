"""LoCo's DDP hook on real workers vs an independent plain-torch computation (docs/algorithms.md §5)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import lowcomm
from lowcomm.codecs import make_codec
from lowcomm.compensation import ErrorFeedback, MovingAverageCompensation
from helpers import batches, tiny_model

STEPS, BETA, GROUP = 4, 0.8, 64


def _loco_worker(rank: int, world: int, beta: float) -> dict:
    model = tiny_model(seed=0)
    # tiny buckets: several per step, and DDP rebuilds them after the first iteration
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = lowcomm.LoCoState(model, bits=4, beta=beta, group_size=GROUP)
    ddp.register_comm_hook(state, lowcomm.loco_hook)
    data = batches(rank, world)
    reduced = []
    for _ in range(STEPS):  # no optimizer step: the same weights, new batches
        x, y = data.next()
        ddp(x, y).backward()
        reduced.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    return {"reduced": reduced, "buckets": state.buckets}


def _quantize_int4(h: torch.Tensor) -> torch.Tensor:
    """Symmetric absmax/7 int4 per block of GROUP elements, round to nearest even: D(Q(h))."""
    flat = h.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), GROUP):
        blk = flat[start:start + GROUP]
        s = blk.abs().amax().clamp(min=2.0 ** -100)
        out[start:start + GROUP] = torch.round(blk * (7 / s)) * (s / 7)
    return out.view_as(h)


def reference_loco(world: int, beta: float):
    models = [tiny_model(seed=0) for _ in range(world)]
    data = [batches(r, world) for r in range(world)]
    err = [dict() for _ in range(world)]
    out, bound = [], []
    for _ in range(STEPS):
        grads = []
        for m, d in zip(models, data):
            x, y = d.next()
            m(x, y).backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
            m.zero_grad()
        step, step_h = {}, {}
        for n in grads[0]:
            total = torch.zeros_like(grads[0][n])
            hs = []
            for w in range(world):
                e = err[w].get(n, torch.zeros_like(grads[w][n]))
                h = grads[w][n] + e
                q = _quantize_int4(h)
                # e <- beta e + (1 - beta)(h - q); add(alpha=) is one fused multiply-add on CPU,
                # so it is written that way here too for a bit-exact comparison
                err[w][n] = (e * beta).add(h - q, alpha=1 - beta)
                total += q
                hs.append(h)
            step[n] = total / world
            step_h[n] = sum(hs) / world
        out.append(step)
        bound.append(step_h)
    return out, bound


def test_loco_hook_equals_plain_torch_exactly(workers):
    res = workers(_loco_worker, 2, BETA)
    torch.set_num_threads(1)
    expected, mean_h = reference_loco(2, BETA)
    assert res[0]["buckets"] > STEPS  # several buckets per step
    for r in res:
        for k in range(STEPS):
            for n, v in expected[k].items():
                assert torch.equal(r["reduced"][k][n], v), (k, n)
    # and within the 4-bit bound of the FP32 mean of what was compensated-and-sent
    for k in range(STEPS):
        for n, v in mean_h[k].items():
            assert (res[0]["reduced"][k][n] - v).abs().max() <= v.abs().max() / 7 + 1e-6


def test_beta_zero_is_plain_error_feedback():
    torch.manual_seed(0)
    codec = make_codec("int4", block_size=GROUP)
    loco = MovingAverageCompensation(0.0)
    ef = ErrorFeedback(1.0)
    for _ in range(5):
        g = torch.randn(300)
        h = loco.compensate("w", g)
        sent_loco = codec.roundtrip(h)
        loco.update("w", h, sent_loco)
        e = ef.accumulate("w", g)
        sent_ef = codec.roundtrip(e)
        ef.subtract("w", sent_ef)
        assert torch.equal(sent_loco, sent_ef)
        assert torch.equal(loco.buffer("w"), ef.buffer("w"))  # both hold the plain residual


def test_loco_strategy_trains(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "loco"
    proc = subprocess.run([sys.executable, "-m", "lowcomm.cli", "train", "--strategy", "loco", "--workers", "2",
                           "--model", "tiny", "--steps", "30", "--out", str(out), "batch_size=4", "seq_len=32",
                           "eval_every=0", "eval_batches=2", "progress=false", "warmup_steps=5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["final_val_loss"] < 5.0  # ln(256) = 5.55 at init
    # 4-bit codes + per-block scales + headers: about 7x fewer wire bytes than FP32 DDP
    assert 6 < s["ddp_fp32_bytes_per_worker"] / s["bytes_sent_per_worker"] < 8


def _diloco_loco_worker(rank: int, world: int) -> dict:
    from helpers import adamw, flat_params

    out = {}
    for codec, comp in (("fp32", "none"), ("loco", "loco")):
        model = tiny_model(seed=0)
        opt = adamw(model)
        data = batches(rank, world)
        sync = lowcomm.DiLoCo(model, opt, sync_every=4, codec=codec, compensation=comp, codec_block=GROUP)
        with sync:
            for _ in range(12):
                x, y = data.next()
                model(x, y).backward()
                opt.step()
                opt.zero_grad()
        out[codec] = {"params": flat_params(model), "stats": sync.stats.as_dict(),
                      "comp": sync.compensation.state_dict() if sync.compensation else None}
    return out


def test_diloco_with_loco_compressed_pseudo_gradients(workers):
    """LoCo as the codec of DiLoCo's outer gradient: 4-bit + moving-average compensation."""
    res = workers(_diloco_loco_worker, 2)
    assert torch.equal(res[0]["loco"]["params"], res[1]["loco"]["params"])
    dense, low = res[0]["fp32"], res[0]["loco"]
    ratio = dense["stats"]["bytes_sent"] / low["stats"]["bytes_sent"]
    assert 6.5 < ratio < 8  # 4 bits + a 32-bit scale per 64 values + headers vs 32 bits
    # close to the FP32 run (the same 12 steps), and the compensation buffers are live
    diff = (dense["params"] - low["params"]).abs().max()
    assert 0 < diff < 0.05
    assert low["comp"]["kind"] == "loco" and len(low["comp"]["buffers"]) > 0
