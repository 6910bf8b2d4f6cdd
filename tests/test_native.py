"""The fused CPU kernels (codecs/_kernels.c) give the same bits as the torch paths they replace,
piece by piece and through whole runs of the engine on real gloo workers."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import adamw, batches, flat_params, local_steps, tiny_model

import lowcomm
from lowcomm.aggregate.gather import GatherAggregator
from lowcomm.codecs import _native, make_codec
from lowcomm.codecs.base import PayloadError
from lowcomm.compensation import ErrorFeedback
from lowcomm.engine.tensors import all_finite, fused_minus, views

pytestmark = pytest.mark.skipif(_native.lib() is None, reason="no C compiler here")


@contextlib.contextmanager
def torch_path():
    """The kernels turned off, as on a machine without a compiler."""
    saved = _native._lib, _native._tried
    _native._lib, _native._tried = None, True
    try:
        yield
    finally:
        _native._lib, _native._tried = saved


def both(fn):
    """fn() with the kernels, then without."""
    fused = fn()
    with torch_path():
        plain = fn()
    return fused, plain


SHAPES = [(256, 320), (513,), (7, 3, 65), (1,), (64, 64), (3,), (4096,)]


def _with_ties(shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    flat[::5] = 0.5  # many equal magnitudes, of both signs
    flat[1::10] = -0.5
    flat[2::13] = 0.0
    return x


@pytest.mark.parametrize("density", [1 / 64, 1 / 32, 0.5])
@pytest.mark.parametrize("shape", SHAPES)
def test_topk_select_same_bits_and_lowest_index_among_ties(density, shape):
    codec = make_codec("topk", density=density)
    x = _with_ties(shape, seed=len(shape))
    (li, lv), (ti, tv) = both(lambda: codec.select(x))
    assert torch.equal(li, ti) and torch.equal(lv, tv)
    # independent: per tile, a stable sort by magnitude (descending) keeps the lowest
    # indices among equal magnitudes
    g = codec.geometry(x.shape)
    tiles = x.reshape(g.R // g.tr, g.tr, g.ntj, g.tc).permute(0, 2, 1, 3).reshape(-1, g.L)
    order = torch.sort(tiles.abs(), dim=1, descending=True, stable=True).indices[:, : g.k]
    assert torch.equal(li, order.sort(dim=1).values)


@pytest.mark.parametrize("block", [256, 128, 100])
@pytest.mark.parametrize("shape", SHAPES + [(100003,)])
def test_fp4_encode_same_bits(block, shape):
    codec = make_codec("fp4", block_size=block)
    x = torch.randn(shape) * torch.rand(shape) ** 4  # many scales and codes
    x.view(-1)[::7] = 0.0
    x.view(-1)[1::11] = 1e-35  # below the smallest code: code 0
    fused, plain = both(lambda: codec.encode(x))
    assert torch.equal(fused, plain)


def test_fp4_encode_non_finite_input_takes_the_torch_path():
    codec = make_codec("fp4")
    x = torch.randn(1000)
    x[3], x[700] = float("nan"), float("inf")
    fused, plain = both(lambda: codec.encode(x))
    assert torch.equal(fused, plain)


def _gathered(codec, aggregation: str, workers: int, seed: int = 0):
    torch.manual_seed(seed)
    agg = GatherAggregator(codec, workers, aggregation=aggregation)
    shapes = [(513,), (64, 77), (3,), (128, 256)]
    base = [torch.randn(s) for s in shapes]
    payloads = [agg.encode([b + 0.5 * w * torch.randn_like(b) for b in base]).payload for w in
                range(workers)]  # fmt: skip
    return agg, payloads, [torch.Size(s) for s in shapes], sum(b.numel() for b in base)


@pytest.mark.parametrize("weights", [None, [3.0, 5.0, 1.0], [1.0, 7.0, 0.0]])
@pytest.mark.parametrize(
    "codec,aggregation",
    [(make_codec("fp4", block_size=128), "mean"), (make_codec("topk"), "selected-mean")],
)
def test_gathered_mean_same_bits(codec, aggregation, weights):
    agg, payloads, shapes, n = _gathered(codec, aggregation, 3)
    fused, plain = both(lambda: agg._sum_gathered(payloads, shapes, n, weights))
    # bit patterns: a sender of weight 0 alone at an entry gives 0/0, NaN on both paths
    assert torch.equal(fused.mean.view(torch.int32), plain.mean.view(torch.int32))
    assert fused.valid_workers == plain.valid_workers == 3


def test_decode_sparse_same_bits_and_same_errors():
    for density, bits in [(1 / 64, 2), (1 / 32, 4), (1 / 64, 3), (1.0, 8)]:
        codec = make_codec("topk", density=density, value_bits=bits)
        for shape in SHAPES:
            payload = codec.encode(torch.randn(shape))
            (fi, fv), (ti, tv) = both(lambda c=codec, p=payload, s=shape: c.decode_sparse(p, s))
            assert torch.equal(fi, ti) and torch.equal(fv, tv)
    codec = make_codec("topk")
    payload = codec.encode(torch.randn(64, 64))
    _, idx_at, _ = codec._layout(codec.geometry((64, 64)))
    bad = payload.clone()
    bad[idx_at] = bad[idx_at + 1]  # two equal indices in the first tile
    messages = []
    for path in (contextlib.nullcontext, torch_path):
        with path(), pytest.raises(PayloadError) as err:
            codec.decode_sparse(bad, (64, 64))
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "strictly increasing" in messages[0]


def test_pseudo_gradient_and_finite_check_in_one_pass():
    params = [torch.randn(30, 7), torch.randn(5), torch.randn(1)]
    ref = torch.randn(sum(p.numel() for p in params))
    out = torch.empty_like(ref)
    snapshot = ref.clone()
    assert fused_minus(views(out, params), ref, params) is True
    assert torch.equal(
        out, torch.cat([(r - p).view(-1) for r, p in zip(views(ref, params), params)])
    )
    assert fused_minus(views(out, params), snapshot, params, snapshot=snapshot) is True
    assert torch.equal(snapshot, torch.cat([p.view(-1) for p in params]))
    params[1][2] = float("nan")
    assert fused_minus(views(out, params), ref, params) is False
    assert not all_finite(out) and all_finite(ref) and all_finite(torch.empty(0))
    params[1][2] = float("-inf")
    assert fused_minus(views(out, params), ref, params) is False
    assert fused_minus(views(out, params), ref, [p.bfloat16() for p in params]) is None


def test_error_feedback_sparse_subtraction_same_bits():
    x = torch.randn(64, 96)
    idx = torch.tensor([0, 5, 97, 6143])
    vals = torch.tensor([0.25, -1.5, 3.0, 1e-3])
    dense = torch.zeros(x.numel())
    dense[idx] = vals
    a, b = ErrorFeedback(0.9), ErrorFeedback(0.9)
    a.accumulate("w", x)
    b.accumulate("w", x)
    a.subtract("w", dense.view_as(x))
    b.subtract_sparse("w", idx, vals)
    assert torch.equal(a.buffer("w"), b.buffer("w"))


def _engine_worker(rank: int, world: int) -> dict:
    out = {}
    for name, make in [
        ("streaming", lambda m, o: lowcomm.StreamingDiLoCo(
            m, o, sync_every=6, fragments=2, blocks_per_fragment=0, overlap=1)),
        ("sparseloco", lambda m, o: lowcomm.SparseLoCo(m, o, sync_every=5)),
        ("co2", lambda m, o: lowcomm.CO2(m, o, sync_every=5)),
    ]:  # fmt: skip
        for path in ("fused", "torch"):
            with torch_path() if path == "torch" else contextlib.nullcontext():
                model = tiny_model(seed=0)
                opt = adamw(model)
                data = batches(rank, world)
                sync = make(model, opt)
                with sync:
                    local_steps(model, opt, data, 17)
                out[(name, path)] = flat_params(model)
    return out


def test_whole_runs_give_the_same_bits_with_and_without_the_kernels(workers):
    for res in workers(_engine_worker, 2):
        for name in ("streaming", "sparseloco", "co2"):
            assert torch.equal(res[(name, "fused")], res[(name, "torch")]), name
