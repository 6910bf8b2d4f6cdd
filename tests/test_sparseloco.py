"""SparseLoCo in the engine vs an independent plain-torch computation of docs/algorithms.md §3."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import adamw, batches, local_steps, tiny_model

import lowcomm

H, ROUNDS, DENSITY, BETA = 3, 3, 1 / 16, 0.95


def _largest_divisor(n: int, limit: int = 64) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def reference_compress(e: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked top-k + 2-bit LUT quantization of one tensor: (decoded tensor, selected mask)."""
    n = e.numel()
    R, C = (e.shape[0], n // e.shape[0]) if e.dim() >= 2 else (1, n)
    tr, tc = _largest_divisor(R), _largest_divisor(C)
    L = tr * tc
    k = min(L, max(1, round(L * density)))  # half to even, as the authors' code
    tiles = e.reshape(R // tr, tr, C // tc, tc).permute(0, 2, 1, 3).reshape(-1, L)
    idx = tiles.abs().topk(k, dim=1).indices.sort(dim=1).values  # tile order, increasing index
    vals = tiles.gather(1, idx).reshape(-1)
    # 2 bits: shift = mean, sigma = unbiased std (on absmax-scaled values), width = 6 sigma / 4,
    # code = clamp(round(x / width + 2), 0, 3); each code decodes to shift + mean of its bin
    shift = vals.mean()
    centred = vals - shift
    m = centred.abs().amax()
    m = m if m > 0 else torch.tensor(1.0)
    sigma = (centred / m).std() * m if vals.numel() > 1 else torch.tensor(0.0)
    width = sigma * 1.5 if sigma > 0 else torch.tensor(1.0)
    codes = (centred / width + 2).round().clamp(0, 3).long()
    lut = torch.stack(
        [centred[codes == c].mean() if (codes == c).any() else (c - 2) * width for c in range(4)]
    )
    deq = lut[codes] + shift
    out_tiles = torch.zeros_like(tiles)
    out_tiles.scatter_(1, idx, deq.view(-1, k))
    mask_tiles = torch.zeros_like(tiles).scatter_(1, idx, 1.0)

    def untile(t):
        return t.reshape(R // tr, C // tc, tr, tc).permute(0, 2, 1, 3).reshape(e.shape)

    return untile(out_tiles), untile(mask_tiles)


def reference_sparseloco(world: int, aggregation: str, extra: int = 0) -> list[torch.Tensor]:
    """Plain-torch SparseLoCo; with ``extra`` steps after the last round, one more sync of them
    (through the error buffers) as leaving the block does."""
    init = tiny_model(seed=0)
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [adamw(m) for m in models]
    data = [batches(r, world) for r in range(world)]
    names = [n for n, _ in init.named_parameters()]
    glob = {n: p.detach().clone() for n, p in init.named_parameters()}
    err = [{n: torch.zeros_like(p) for n, p in glob.items()} for _ in range(world)]
    out = []
    for r in range(ROUNDS + (1 if extra else 0)):
        for model, o, d in zip(models, opts, data):
            local_steps(model, o, d, H if r < ROUNDS else extra)
        for n in names:
            total = torch.zeros_like(glob[n])
            count = torch.zeros_like(glob[n])
            for w, model in enumerate(models):
                delta = glob[n] - dict(model.named_parameters())[n].detach()
                err[w][n] = BETA * err[w][n] + delta
                sent, mask = reference_compress(err[w][n], DENSITY)
                err[w][n] = err[w][n] - sent
                total += sent
                count += mask
            avg = total / world if aggregation == "mean" else total / count.clamp(min=1)
            glob[n] = glob[n] - 1.0 * avg
        for model in models:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(glob[n])
        out.append(torch.cat([glob[n].reshape(-1) for n in names]))
    return out


def _sparseloco_worker(rank: int, world: int, aggregation: str, extra: int = 0) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.SparseLoCo(
        model, opt, sync_every=H, density=DENSITY, error_decay=BETA, aggregation=aggregation
    )
    out = []
    with sync:
        for step in range(1, H * ROUNDS + extra + 1):
            x, y = data.next()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if step % H == 0:
                out.append(sync.global_flat().clone())
    return {
        "globals": out,
        "final": sync.global_flat().clone(),
        "stats": sync.stats.as_dict(),
        "shapes": [p.shape for p in model.parameters()],
    }


@pytest.mark.parametrize("aggregation", ["mean", "selected-mean"])
def test_sparseloco_matches_plain_torch(workers, aggregation):
    res = workers(_sparseloco_worker, 2, aggregation)
    torch.set_num_threads(1)
    expected = reference_sparseloco(2, aggregation)
    for r in res:
        for k in range(ROUNDS):
            torch.testing.assert_close(
                r["globals"][k], expected[k], atol=1e-6, rtol=0, msg=f"outer step {k + 1}"
            )
    assert torch.equal(res[0]["globals"][-1], res[1]["globals"][-1])
    # bytes: every sync all-gathers one payload per worker: wire = (M - 1) x payload
    from lowcomm.aggregate import make_aggregator

    agg = make_aggregator(lowcomm.preset_config("sparseloco", density=DENSITY), world_size=2)
    st = res[0]["stats"]
    assert st["payload_bytes"] == ROUNDS * agg.payload_nbytes(res[0]["shapes"])
    assert st["bytes_sent"] == st["bytes_received"] == (2 - 1) * st["payload_bytes"]


def test_sparseloco_partial_round_is_not_lost(workers):
    """Leaving the block 2 steps into a round syncs those steps through the error buffers."""
    res = workers(_sparseloco_worker, 2, "selected-mean", 2)
    torch.set_num_threads(1)
    expected = reference_sparseloco(2, "selected-mean", extra=2)
    assert len(expected) == ROUNDS + 1
    for r in res:
        torch.testing.assert_close(r["final"], expected[-1], atol=1e-6, rtol=0)
    assert res[0]["stats"]["final_syncs"] == 1


def test_payload_bytes_match_the_format_formula():
    """small model: ceil(log2 chunk) index bits + 2 value bits per kept entry, plus headers."""
    from lowcomm.aggregate import encode_tensors, make_aggregator
    from lowcomm.codecs import make_codec
    from lowcomm.train.model import build_model

    cfg = lowcomm.preset_config("sparseloco")
    model = build_model("small")
    shapes = [p.shape for p in model.parameters()]
    agg = make_aggregator(cfg, world_size=4)
    payload = agg.payload_nbytes(shapes)
    expected = 1  # the payload's validity flag
    for shape in shapes:
        n = math.prod(shape)
        R, C = (shape[0], n // shape[0]) if len(shape) >= 2 else (1, n)
        L = _largest_divisor(R) * _largest_divisor(C)
        K = (n // L) * min(L, max(1, round(L * cfg.density)))
        index_bits = math.ceil(math.log2(L))
        # per tensor: 16-byte top-k header, 16-byte value header + fp32 shift + 4 fp32 LUT entries
        expected += 16 + 16 + 4 * 5 + math.ceil(2 * K / 8) + math.ceil(index_bits * K / 8)
    assert abs(payload - expected) / expected < 0.02, (payload, expected)
    n_all = sum(math.prod(s) for s in shapes)
    codec = make_codec("topk", density=cfg.density, value_bits=2)
    entry_bits = sum(codec.formula_bits_per_param(s) * math.prod(s) for s in shapes)
    print(
        f"small: {payload} B per sync per worker, {payload * 8 / n_all:.3f} bits/param; "
        f"entries {entry_bits / 8:.0f} B + headers {payload - entry_bits / 8:.0f} B"
    )
    assert payload * 8 / n_all < 0.25  # about 0.22 bits per parameter at density 1/64
    # the real encoded size equals what the aggregator reports (bytes come from real tensors)
    enc = encode_tensors(agg, [torch.randn(s) for s in shapes])
    assert enc.payload.numel() == payload


def test_k_rounds_half_to_even_like_the_authors():
    """k = round(L * density) with Python's round (half to even), as the authors' code does."""
    from lowcomm.codecs.topk import _Geometry

    assert _Geometry(torch.Size([10]), 0.25).k == 2  # 2.5 -> 2 (half up would keep 3)
    assert _Geometry(torch.Size([10]), 0.35).k == 4  # 3.5 -> 4
    assert _Geometry(torch.Size([64, 64]), 1 / 64).k == 64


def _overlapped_worker(rank: int, world: int) -> dict:
    model = tiny_model(seed=0)
    opt = adamw(model)
    data = batches(rank, world)
    sync = lowcomm.SparseLoCo(model, opt, sync_every=H, density=DENSITY, overlap=1)
    with sync:
        local_steps(model, opt, data, H * ROUNDS + 1)
    return {
        "global": sync.global_flat().clone(),
        "merge": sync.config.merge,
        "syncs": sync.stats.syncs,
        "final_syncs": sync.stats.final_syncs,
    }


def test_sparseloco_with_overlap_continues_and_ends_as_one_model(workers):
    """tau = 1: SparseLoCo's result lands a step late and merges by the continue rule (its
    preset default for overlap), so no worker blocks at a sync; leaving yields one model."""
    res = workers(_overlapped_worker, 2)
    assert res[0]["merge"] == "continue"
    assert res[0]["syncs"] == ROUNDS and res[0]["final_syncs"] == 1
    assert torch.equal(res[0]["global"], res[1]["global"])
    assert torch.isfinite(res[0]["global"]).all()
