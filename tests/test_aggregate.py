"""Compressed collectives on real workers: all-gather + FP32 sum, and the two-phase reduce."""

from __future__ import annotations

import pytest
import torch

from lowcomm.aggregate import TwoPhaseAggregator, aggregator_for, encode_tensors
from lowcomm.codecs import make_codec
from lowcomm.transport import Transport

SHAPES = [torch.Size([37, 64]), torch.Size([130]), torch.Size([5, 3, 7])]


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(s, generator=g) * (rank + 1) for s in SHAPES]


def _agg_worker(rank: int, world: int, method: str, codec_name: str, aggregation: str) -> dict:
    codec = make_codec(codec_name, block_size=32, density=1 / 8)
    agg = aggregator_for(method, codec, world, aggregation=aggregation)
    t = Transport()
    enc = encode_tensors(agg, _inputs(rank), want="dense")
    red = agg.exchange(enc, t)
    return {
        "mean": red.mean,
        "valid": red.valid_workers,
        "meter": t.meter.as_dict(),
        "payload": enc.payload.numel(),
    }


@pytest.mark.parametrize(
    "world,codec",
    [(2, "topk"), pytest.param(4, "fp4", marks=pytest.mark.slow)],  # 4: by hand
)
def test_gather_equals_fp32_sum_of_decoded_payloads(workers, world, codec):
    res = workers(_agg_worker, world, "gather", codec, "mean")
    c = make_codec(codec, block_size=32, density=1 / 8)
    decoded = [torch.cat([c.roundtrip(x).reshape(-1) for x in _inputs(r)]) for r in range(world)]
    expected = sum(decoded) / world
    for r in res:
        assert r["valid"] == world
        torch.testing.assert_close(r["mean"], expected, atol=1e-6, rtol=1e-6)
        assert r["meter"]["sent_bytes"] == (world - 1) * r["payload"]  # all-gather ring cost


@pytest.mark.parametrize(
    "world,codec",
    [(3, "fp4"), pytest.param(4, "int8", marks=pytest.mark.slow)],  # 4: by hand
)
def test_two_phase_reduce(workers, world, codec):
    res = workers(_agg_worker, world, "two-phase", codec, "mean")
    c = make_codec(codec, block_size=32)
    flat = [torch.cat([x.reshape(-1) for x in _inputs(r)]) for r in range(world)]
    n = flat[0].numel()
    per_owner = -(-n // world)  # ceil(n / world)
    shard = -(-per_owner // 32) * 32  # whole blocks of 32 per owner
    padded = [torch.nn.functional.pad(f, (0, shard * world - n)) for f in flat]
    # phase 1: each owner decodes every worker's encoded shard and sums in FP32
    means = []
    for j in range(world):
        s = sum(c.roundtrip(p[j * shard : (j + 1) * shard]) for p in padded) / world
        means.append(c.roundtrip(s))  # phase 2: re-encoded average, all-gathered
    expected = torch.cat(means)[:n]
    for r in res:
        torch.testing.assert_close(r["mean"], expected, atol=1e-6, rtol=1e-6)
        # wire: all-to-all (M-1)/M of the input, then all-gather (M-1) x one shard payload;
        # about 2x payload/M x (M-1) whatever M is, where a gather would cost (M-1) x payload
        assert r["meter"]["sent_bytes"] < 2 * r["payload"]
    # and it is close to the exact mean (two quantizations)
    exact = sum(flat) / world
    assert (res[0]["mean"] - exact).abs().max() < 0.5 * exact.abs().max()


def test_selected_mean_averages_only_the_senders(workers):
    res = workers(_agg_worker, 2, "gather", "topk", "selected-mean")
    c = make_codec("topk", density=1 / 8)
    total, count = [], []
    for shape in SHAPES:
        t = torch.zeros(shape.numel())
        k = torch.zeros(shape.numel())
        for r in range(2):
            x = _inputs(r)[SHAPES.index(shape)]
            idx, vals = c.decode_sparse(c.encode(x), shape, "t")
            t.index_add_(0, idx, vals)
            k.index_add_(0, idx, torch.ones_like(vals))
        total.append(t)
        count.append(k)
    expected = torch.cat(total) / torch.cat(count).clamp(min=1)
    torch.testing.assert_close(res[0]["mean"], expected, atol=1e-6, rtol=1e-6)


WEIGHTS = [3.0, 1.0, 0.0]  # quorum rounds: inner steps each contribution holds (0: none)


def _weighted_worker(rank: int, world: int, method: str, codec_name: str, aggregation: str):
    codec = make_codec(codec_name, block_size=32, density=1 / 8)
    agg = aggregator_for(method, codec, world, aggregation=aggregation)
    enc = encode_tensors(agg, _inputs(rank), valid=WEIGHTS[rank] > 0)
    red = agg.exchange(enc, Transport(), WEIGHTS)
    return {"mean": red.mean, "valid": red.valid_workers}


@pytest.mark.parametrize(
    "method,codec,aggregation",
    [
        ("gather", "topk", "mean"),
        ("gather", "topk", "selected-mean"),
        # by hand: test_rounds.py recomputes DiLoCo's weighted all-reduce end to end
        pytest.param("allreduce", "fp32", "mean", marks=pytest.mark.slow),
        pytest.param("two-phase", "fp4", "mean", marks=pytest.mark.slow),  # not elastic yet
    ],
)
def test_the_weighted_mean_is_sum_w_x_over_sum_w(workers, method, codec, aggregation):
    res = workers(_weighted_worker, 3, method, codec, aggregation)
    c = make_codec(codec, block_size=32, density=1 / 8)
    flat = [torch.cat([x.reshape(-1) for x in _inputs(r)]) for r in range(3)]
    if method == "two-phase":  # each owner's shard, then the re-encoded mean: see above
        n = flat[0].numel()
        per_owner = -(-n // 3)  # ceil(n / 3), then whole blocks of 32
        shard = -(-per_owner // 32) * 32
        padded = [torch.nn.functional.pad(f, (0, shard * 3 - n)) for f in flat]
        parts = []
        for j in range(3):
            s = sum(
                w * c.roundtrip(p[j * shard : (j + 1) * shard]) for w, p in zip(WEIGHTS, padded)
            )
            parts.append(c.roundtrip(s / sum(WEIGHTS)))
        expected = torch.cat(parts)[:n]
    elif aggregation == "selected-mean":  # per element: over the weights of those that sent it
        total, weight = torch.zeros_like(flat[0]), torch.zeros_like(flat[0])
        for w, r in zip(WEIGHTS[:2], range(2)):
            offset = 0
            for x in _inputs(r):
                idx, vals = c.decode_sparse(c.encode(x), x.shape, "t")
                total[offset:].index_add_(0, idx, w * vals)
                weight[offset:].index_add_(0, idx, torch.full_like(vals, w))
                offset += x.numel()
        expected = total / weight.clamp(min=1e-12)
    else:
        dec = [c.roundtrip(f) if codec != "fp32" else f for f in flat]
        if codec == "topk":  # per tensor, as sent
            dec = [torch.cat([c.roundtrip(x).reshape(-1) for x in _inputs(r)]) for r in range(3)]
        expected = sum(w * d for w, d in zip(WEIGHTS, dec)) / sum(WEIGHTS)
    for r in res:
        assert r["valid"] == 2
        torch.testing.assert_close(r["mean"], expected, atol=1e-6, rtol=1e-6)
    plain = sum(flat[:2]) / 2  # the check tells the weighted mean from the plain one
    assert not torch.allclose(res[0]["mean"], plain, atol=1e-3)


ROUNDS = 3


def _compensated_worker(rank: int, world: int, key: str | None) -> list[torch.Tensor]:
    from lowcomm.compensation import MovingAverageCompensation

    comp = MovingAverageCompensation(0.8)
    agg = TwoPhaseAggregator(
        make_codec("int4-authors", block_size=32), world, reduce_compensation=comp
    )
    t = Transport()
    out = []
    for _ in range(ROUNDS):  # the same inputs each round: only the second buffer changes
        out.append(agg.exchange(encode_tensors(agg, _inputs(rank), key=key), t).mean)
        agg.step()
    return out


def test_two_phase_second_quantisation_is_compensated(workers):
    """Each owner keeps e for its averaged shard: h = mean + e; send Q(h);
    e <- 0.8 e + 0.2 (h - Q(h))."""
    res = workers(_compensated_worker, 3, "bucket 0")
    plain = workers(_compensated_worker, 3, None)  # no key: the second quantisation as before
    c = make_codec("int4-authors", block_size=32)
    flat = [torch.cat([x.reshape(-1) for x in _inputs(r)]) for r in range(3)]
    n = flat[0].numel()
    per_owner = -(-n // 3)  # ceil(n / 3)
    shard = -(-per_owner // 32) * 32  # whole blocks of 32 per owner
    padded = [torch.nn.functional.pad(f, (0, shard * 3 - n)) for f in flat]
    means = [sum(c.roundtrip(p[j * shard : (j + 1) * shard]) for p in padded) / 3 for j in range(3)]
    err = [torch.zeros(shard) for _ in range(3)]
    for k in range(ROUNDS):
        sent = []
        for j in range(3):
            h = means[j] + err[j]
            q = c.roundtrip(h)
            err[j] = (err[j] * 0.8).add(h - q, alpha=0.2)
            sent.append(q)
        for r in range(3):
            assert torch.equal(res[r][k], torch.cat(sent)[:n]), (k, r)
            assert torch.equal(plain[r][k], torch.cat([c.roundtrip(m) for m in means])[:n])
    # compensated, the running average of what arrives approaches the FP32 mean of the shards
    exact = torch.cat(means)[:n]
    drift = (torch.stack(res[0]).mean(0) - exact).norm()
    assert drift < (torch.stack(plain[0]).mean(0) - exact).norm()


def test_make_aggregator_compensates_the_second_quantisation_like_the_first():
    from lowcomm.aggregate import make_aggregator
    from lowcomm.compensation import ErrorFeedback, MovingAverageCompensation
    from lowcomm.config import SyncConfig

    def built(**kw):
        return make_aggregator(SyncConfig(codec="int4", **kw), 4).reduce_compensation

    assert isinstance(built(reduce="two-phase", compensation="loco"), MovingAverageCompensation)
    assert isinstance(built(reduce="two-phase", compensation="ef"), ErrorFeedback)
    assert built(reduce="two-phase") is None and built(reduce="gather", compensation="loco") is None
    assert built(reduce="two-phase", compensation="loco", loco_reset_every=7).reset_every == 7


def _flagged_worker(rank: int, world: int, told: bool) -> dict:
    """Worker 1's top-k payload flagged NONFINITE (2), gathered where that flag is allowed
    (``told``: senders defer their finite check) or not."""
    from lowcomm.errors import PayloadError

    agg = aggregator_for("gather", make_codec("topk", density=1 / 8), world)
    agg.deferred_checks = told
    enc = encode_tensors(agg, _inputs(rank), want="dense")
    if rank == 1:
        enc.payload[-1] = 2
    try:
        red = agg.exchange(enc, Transport())
    except PayloadError as e:
        return {"error": str(e), "blamed": e.sender}
    return {"valid": red.valid_workers, "nonfinite": red.nonfinite, "here": red.left_out_here}


def test_a_payload_flagged_not_finite_is_left_out_only_where_senders_defer(workers):
    """Flag 2 (not finite, found on the sender's device) leaves its sender out and tells it
    so; where no sender defers (an elastic run), it is a bad payload, blamed on its sender."""
    told = workers(_flagged_worker, 2, True)
    assert [(r["valid"], r["nonfinite"], r["here"]) for r in told] == [
        (1, (1,), False),
        (1, (1,), True),
    ]
    refused = workers(_flagged_worker, 2, False)
    assert all(
        r["blamed"] == 1 and "validity flag 2, expected 0 or 1" in r["error"] for r in refused
    )
