"""A block codec over a whole bucket at once (codecs/block_many.py): the same bytes as the
per-tensor codec writes tensor by tensor, the same decode, and every check the per-tensor
decode makes as the plan's one flag."""

from __future__ import annotations

import pytest
import torch

from lowcomm.aggregate import batched
from lowcomm.aggregate.gather import GatherAggregator
from lowcomm.codecs import PayloadError, make_codec
from lowcomm.codecs.block_many import BlockPlan

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEVICE_PARAMS = [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES]
CODECS = ["int8", "int4", "int2", "fp4"]

#: whole blocks and planes; a short last block; 0-d, empty, odd; a partial plane of int2 after
#: whole ones; a tensor that starts inside a plane of the one before
SHAPES = [(4, 256), (768,), (300,), (), (0,), (7,), (2, 1500), (1024 + 256,), (3, 5, 17)]
ALIGNED = [(2, 768), (768,), (256,), (2304,), (4, 1024)]


def bucket(shapes, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ts = [
        torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 3, (), generator=g) for s in shapes
    ]
    if ts and ts[0].numel() > 300:
        ts[0].view(-1)[:256] = 0.0  # a block of zeros: its scale is the floor
    return ts


def per_tensor(codec, tensors) -> torch.Tensor:
    return torch.cat([codec.encode(t).cpu() for t in tensors])


def encoded(codec, tensors, device) -> tuple[BlockPlan, torch.Tensor]:
    plan = codec.plan([t.shape for t in tensors], torch.device(device))
    assert isinstance(plan, BlockPlan)
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    out = torch.empty(plan.nbytes + 1, dtype=torch.uint8, device=device)
    assert plan.encode(flat, out) == (None, None)
    return plan, out[:-1]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("shapes", [SHAPES, ALIGNED], ids=["mixed", "aligned"])
@pytest.mark.parametrize("block", [256, 128, 96])
def test_bucket_bytes_and_decode_are_the_per_tensor_codecs(name, shapes, block, device):
    codec = make_codec(name, block_size=block)
    tensors = bucket(shapes)
    plan, payload = encoded(codec, tensors, device)
    assert plan.aligned == all(torch.Size(s).numel() % block == 0 for s in shapes)
    want = per_tensor(codec, tensors)
    assert torch.equal(payload.cpu(), want)
    idx, values, bad = plan.decode(payload)
    assert idx is None and not bool(bad)
    ref = torch.cat(
        [codec.decode(want[a:b], t.shape).reshape(-1) for (a, b), t in _spans(codec, tensors)]
    )
    assert torch.equal(values.cpu(), ref)


def _spans(codec, tensors):
    at = 0
    for t in tensors:
        n = codec.nbytes(t.shape)
        yield (at, at + n), t
        at += n


@pytest.mark.parametrize("name", CODECS)
def test_every_check_of_the_per_tensor_decode_sets_the_flag(name):
    """A header, a scale or a code the per-tensor decoder refuses sets the plan's flag."""
    codec = make_codec(name)
    tensors = bucket(SHAPES, seed=1)
    plan, payload = encoded(codec, tensors, "cpu")
    (a, _), t = list(_spans(codec, tensors))[6]  # the (2, 1500) tensor
    codes_at = a + 16 + 4 * (-(-t.numel() // codec.block_size))
    invalid = 0 if name != "fp4" else 0x88  # int: code 0; fp4: 0b1000 in both fields
    cases = {
        "header": (a + 2, 99),  # its codec id
        "numel": (a + 8, 1),
        "scale": (a + 16 + 3, 0xFF),  # the first scale's top byte: NaN
        "code": (codes_at + 5, invalid),
    }
    for what, (at, byte) in cases.items():
        bad_payload = payload.clone()
        bad_payload[at] = byte
        with pytest.raises(PayloadError):
            codec.decode(bad_payload[a : a + codec.nbytes(t.shape)], t.shape)
        assert bool(plan.decode(bad_payload)[2]), what


@pytest.mark.parametrize("name", CODECS)
def test_a_bucket_of_empty_tensors_is_its_headers(name):
    codec = make_codec(name)
    tensors = [torch.zeros(0), torch.zeros(3, 0)]
    plan, payload = encoded(codec, tensors, "cpu")
    assert torch.equal(payload, per_tensor(codec, tensors))
    idx, values, bad = plan.decode(payload)
    assert values.numel() == 0 and not bool(bad)


def test_no_plan_where_the_draws_would_differ():
    cpu = torch.device("cpu")
    assert make_codec("int4", stochastic=True).plan([torch.Size([256])], cpu) is None
    assert make_codec("int4", block_size=64).plan([torch.Size([256])], cpu) is not None


@pytest.mark.parametrize("weights", [None, [1.0, 3.0, 2.0]])
def test_bucket_combine_equals_per_tensor(weights):
    codec = make_codec("int4")
    shapes = [torch.Size(s) for s in SHAPES]
    numel = sum(s.numel() for s in shapes)
    gathered = [
        torch.cat([per_tensor(codec, bucket(SHAPES, 10 + w)), torch.tensor([f], dtype=torch.uint8)])
        for w, f in enumerate([1, 0, 1])
    ]
    agg = GatherAggregator(codec, 3, "mean")
    want = agg._sum_gathered(gathered, shapes, numel, weights)
    plan = codec.plan(shapes, torch.device("cpu"))
    assert batched.combines(plan, agg.rule, weights, None)
    assert not batched.combines(plan, GatherAggregator(codec, 3, "selected-mean").rule, None, None)
    got = batched.combine(plan, agg.rule, gathered, numel, weights, None)
    assert got is not None and got.valid_workers == want.valid_workers == 2
    assert torch.equal(got.mean, want.mean)
    gathered[2][40] = 0  # a code 0 in the first tensor of the third: the per-tensor path names it
    assert batched.combine(plan, agg.rule, gathered, numel, weights, None) is None
    with pytest.raises(PayloadError) as err:
        agg._sum_gathered(gathered, shapes, numel)
    assert err.value.sender == 2


@pytest.mark.parametrize("codec", ["int4", "fp4"])
def test_streaming_at_once_equals_tensor_by_tensor(workers, codec, monkeypatch):
    """A real two-worker Streaming run ends with the same global weights, bit for bit, with
    each bucket encoded, decoded and combined at once (as on a GPU) and tensor by tensor."""
    from test_streaming import _streaming_worker

    runs = {}
    for at_once in ("0", "1"):  # H = 6, 3 fragments, tau = 1, alpha = 0.5, 14 steps
        monkeypatch.setenv("LOWCOMM_BATCH", at_once)
        runs[at_once] = [
            r["global"] for r in workers(_streaming_worker, 2, 6, 3, 1, 0.5, 14, codec)
        ]
    for name, value in runs["0"][0].items():
        for r in (*runs["0"], *runs["1"]):
            assert torch.equal(r[name], value), name
