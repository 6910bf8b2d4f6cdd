"""Top-k over a whole bucket at once (codecs/topk_many.py, aggregate/batched.py): the same
bytes, decodes and combinations as the per-tensor codec, checked against it tensor by tensor."""

from __future__ import annotations

import random

import pytest
import torch

from lowcomm.aggregate import batched
from lowcomm.aggregate.base import Encoded
from lowcomm.aggregate.gather import GatherAggregator
from lowcomm.codecs import PayloadError, make_codec
from lowcomm.codecs.bitpack import pack_bits
from lowcomm.codecs.bitpack_many import Stream, Streams
from lowcomm.codecs.topk_many import TopKPlan
from lowcomm.compensation import ErrorFeedback

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEVICE_PARAMS = [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d for d in DEVICES]

#: a 2-D tile of 64 x 64, a 29-row one, 1 x 64 pieces, 0-d, empty, one element, 3-D, odd
SHAPES = [(96, 128), (128,), (87, 128), (), (0,), (1,), (5, 7, 64), (4096,), (3, 4), (64, 192)]


def bucket(seed: int = 0) -> list[torch.Tensor]:
    """Tensors of SHAPES with ties, whole numbers and zero rows (the tie rule's hard cases)."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g) for s in SHAPES]
    ts[0][3, :] = 0.5
    ts[0][5, 10:20] = -0.5
    ts[2] = torch.randint(-3, 4, ts[2].shape, generator=g).float()
    ts[9][:, :64] = 0.0
    return ts


def per_tensor(codec, tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([codec.encode(t) for t in tensors])


def stats_bytes(codec, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A mask of the payload bytes holding each tensor's table (shift and lut)."""
    mask, at = [], 0
    for t in tensors:
        n = codec.nbytes(t.shape)
        m = torch.zeros(n, dtype=torch.bool)
        if t.numel():
            m[32 : codec.value_codec._codes_at() + 16] = True
        mask.append(m)
        at += n
    return torch.cat(mask)


def sparse_reference(codec, payload: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor decode_sparse, shifted into the bucket's flat coordinates."""
    at = elem = 0
    idx, vals = [], []
    for s in shapes:
        nb = codec.nbytes(torch.Size(s))
        i, v = codec.decode_sparse(payload[at : at + nb].cpu(), torch.Size(s))
        idx.append(i + elem)
        vals.append(v)
        at += nb
        elem += torch.Size(s).numel()
    return torch.cat(idx), torch.cat(vals)


def test_streams_pack_like_pack_bits():
    rnd = random.Random(0)
    for _ in range(40):
        streams, values, want = [], [], []
        first = at = 0
        for _ in range(rnd.randint(1, 6)):
            bits = rnd.choice([0, 1, 2, 3, 4, 6, 8, 11, 12, 13, 16, 20])
            n = rnd.choice([0, 1, 5, 255, 256, 257, 1023, 1024, 1025, 3000])
            v = torch.randint(0, 1 << bits, (n,)) if bits else torch.zeros(n, dtype=torch.int64)
            gap = rnd.randint(0, 3)  # streams need not be adjacent
            want.append(torch.zeros(gap, dtype=torch.uint8))
            at += gap
            streams.append(Stream(first, n, bits, at))
            packed = pack_bits(v, bits)
            want.append(packed)
            values.append(v)
            at += packed.numel()
            first += n
        plan = Streams(streams, torch.device("cpu"))
        out = torch.zeros(at + 1, dtype=torch.uint8)
        plan.pack(torch.cat(values), out, sink=at)
        assert torch.equal(out[:at], torch.cat(want))
        assert torch.equal(plan.unpack(out, first), torch.cat(values))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_plan_writes_the_per_tensor_bytes(device):
    """Every byte but the tables' float statistics equal to the per-tensor codec's (those
    within float32 rounding); the indices, the codes and the headers exactly."""
    codec = make_codec("topk")
    ts = bucket()
    flat = torch.cat([t.reshape(-1) for t in ts]).to(device)
    plan = TopKPlan(codec, [t.shape for t in ts], torch.device(device))
    out = torch.zeros(plan.nbytes + 1, dtype=torch.uint8, device=device)
    idx, decoded = plan.encode(flat, out)
    want = per_tensor(codec, ts)  # the CPU's per-tensor codec
    got = out[:-1].cpu()
    stats = stats_bytes(codec, ts)
    assert torch.equal(got[~stats], want[~stats])
    assert torch.allclose(got[stats].view(torch.float32), want[stats].view(torch.float32),
                          rtol=2e-6, atol=0)  # fmt: skip
    # what it says peers decode is what the per-tensor decoder reads from its bytes
    ref_idx, ref_vals = sparse_reference(codec, got, [t.shape for t in ts])
    assert torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(decoded.cpu(), ref_vals)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_plan_decodes_the_per_tensor_payload(device):
    codec = make_codec("topk", density=1 / 16)
    ts = bucket(1)
    payload = per_tensor(codec, ts)
    plan = TopKPlan(codec, [t.shape for t in ts], torch.device(device))
    idx, vals, bad = plan.decode(payload.to(device))
    assert not bool(bad)
    ref_idx, ref_vals = sparse_reference(codec, payload, [t.shape for t in ts])
    assert torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(vals.cpu(), ref_vals)


def _corrupt(codec, payload, ts, how):
    p = payload.clone()
    first = codec.nbytes(ts[0].shape)
    g = codec.geometry(ts[0].shape)
    idx_at = codec._layout(g)[1]
    if how == "magic":
        p[first] = ord("X")  # the second tensor's header
    elif how == "table":
        p[32:36] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)  # NaN shift
    elif how == "order":  # every index of the first tensor 0: not increasing in a tile
        p[idx_at:first] = 0
    return p


@pytest.mark.parametrize("how", ["magic", "table", "order"])
def test_plan_flags_what_the_decoder_rejects(how, monkeypatch):
    codec = make_codec("topk")
    ts = bucket(2)
    shapes = [t.shape for t in ts]
    bad_payload = _corrupt(codec, per_tensor(codec, ts), ts, how)
    plan = TopKPlan(codec, shapes, torch.device("cpu"))
    assert bool(plan.decode(bad_payload)[2])
    with pytest.raises(PayloadError):  # the per-tensor decoder agrees, and names it
        sparse_reference(codec, bad_payload, shapes)
    monkeypatch.setenv("LOWCOMM_BATCH", "1")  # the codec's own single-tensor plan, then its check
    with pytest.raises(PayloadError):
        sparse_reference(codec, bad_payload, shapes)


def test_plan_flags_an_index_past_its_tile():
    codec = make_codec("topk")
    x = torch.randn(1, 48)  # one tile of 48, k = 1, 6-bit indices
    payload = codec.encode(x)
    payload[-1] = 0xFF  # the index's two high bits set: 48 or more
    plan = TopKPlan(codec, [x.shape], torch.device("cpu"))
    assert bool(plan.decode(payload)[2])
    with pytest.raises(PayloadError, match="out of range"):
        codec.decode_sparse(payload, x.shape)


def _gathered(codec, senders: int, valid: list[bool]) -> list[torch.Tensor]:
    out = []
    for w in range(senders):
        p = per_tensor(codec, bucket(10 + w))
        out.append(torch.cat([p, torch.tensor([int(valid[w])], dtype=torch.uint8)]))
    return out


@pytest.mark.parametrize("rule", ["mean", "selected-mean"])
@pytest.mark.parametrize("weights", [None, [1.0, 3.0, 2.0]])
def test_bucket_combine_equals_per_tensor(rule, weights):
    codec = make_codec("topk")
    shapes = [t.shape for t in bucket()]
    numel = sum(s.numel() for s in shapes)
    agg = GatherAggregator(codec, 3, rule)
    gathered = _gathered(codec, 3, [True, False, True])
    want = agg._sum_gathered(gathered, shapes, numel, weights)
    plan = TopKPlan(codec, shapes, torch.device("cpu"))
    got = batched.combine(plan, agg.rule, gathered, numel, weights, None)
    assert got is not None and got.valid_workers == want.valid_workers == 2
    assert torch.equal(got.mean, want.mean)


def test_bucket_combine_leaves_a_bad_sender_to_the_per_tensor_path():
    codec = make_codec("topk")
    ts = bucket()
    shapes = [t.shape for t in ts]
    gathered = _gathered(codec, 2, [True, True])
    gathered[1] = torch.cat([_corrupt(codec, gathered[1][:-1], ts, "table"), gathered[1][-1:]])
    plan = TopKPlan(codec, shapes, torch.device("cpu"))
    agg = GatherAggregator(codec, 2, "selected-mean")
    numel = sum(s.numel() for s in shapes)
    assert batched.combine(plan, agg.rule, gathered, numel, None, None) is None
    with pytest.raises(PayloadError) as err:
        agg._sum_gathered(gathered, shapes, numel)
    assert err.value.sender == 1
    gathered[1][-1] = 7  # a flag that is neither 0 nor 1
    assert batched.combine(plan, agg.rule, gathered, numel, None, None) is None


def test_error_feedback_at_once_equals_tensor_by_tensor():
    codec = make_codec("topk")
    names = [f"p{i}" for i in range(len(SHAPES))]
    by_tensor, at_once = ErrorFeedback(0.9, device=None), ErrorFeedback(0.9, device=None)
    plan = TopKPlan(codec, [torch.Size(s) for s in SHAPES], torch.device("cpu"))
    for step in range(3):
        ts = bucket(20 + step)
        flat = torch.cat([t.reshape(-1) for t in ts])
        e = at_once.accumulate_flat(names, ts, flat)
        idx, vals = plan.encode(e, torch.empty(plan.nbytes + 1, dtype=torch.uint8))
        shapes = [t.shape for t in ts]
        enc = Encoded(torch.empty(0), shapes, flat.numel(), None, sparse_flat=(idx, vals))
        at_once.subtract_flat(e, enc)
        for n, t, (i, v) in zip(names, ts, _split(idx, vals, ts)):
            by_tensor.accumulate(n, t)
            by_tensor.subtract_sparse(n, i, v)
        for n in names:
            assert torch.equal(at_once.buffer(n), by_tensor.buffer(n)), (step, n)
    # a loaded state is taken up again by the next group at once
    restored = ErrorFeedback(0.9, device=None)
    restored.load_state_dict(at_once.state_dict())
    ts = bucket(30)
    flat = torch.cat([t.reshape(-1) for t in ts])
    again = restored.accumulate_flat(names, ts, flat)
    assert again is not None and torch.equal(again, at_once.accumulate_flat(names, ts, flat))
    assert ErrorFeedback(0.9, dtype="bf16", device=None).accumulate_flat(names, ts, flat) is None


def _split(idx: torch.Tensor, vals: torch.Tensor, ts: list[torch.Tensor]):
    """Bucket coordinates -> per tensor (local flat indices, values)."""
    at = 0
    for t in ts:
        inside = (idx >= at) & (idx < at + t.numel())
        yield idx[inside] - at, vals[inside]
        at += t.numel()


def test_tracked_norms_match_per_tensor():
    codec = make_codec("topk")
    shapes = [t.shape for t in bucket()]
    numel = sum(s.numel() for s in shapes)
    agg = GatherAggregator(codec, 3, "selected-mean")
    agg.track = True
    gathered = _gathered(codec, 3, [True, True, False])
    want = agg._sum_gathered(gathered, shapes, numel)
    plan = TopKPlan(codec, shapes, torch.device("cpu"))
    got = batched.combine(plan, agg.rule, gathered, numel, None, None, track=True)
    assert got is not None and got.norms is not None and want.norms is not None
    assert set(got.norms) == set(want.norms) == {0, 1}
    for w in want.norms:
        assert got.norms[w] == pytest.approx(want.norms[w], rel=1e-12)
    assert torch.equal(got.mean, want.mean)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_ranking_by_topk_equals_the_exact_key_without_ties(device):
    codec = make_codec("topk")
    shapes = [torch.Size(s) for s in [(256, 256), (87, 128), (3072,), (64, 192)]]
    flat = torch.randn(sum(s.numel() for s in shapes), device=device)
    plan = TopKPlan(codec, shapes, torch.device(device))
    fast_local = torch.empty(plan.kept, dtype=torch.int64, device=device)
    fast_values = torch.empty(plan.kept, device=device)
    exact_local, exact_values = fast_local.clone(), fast_values.clone()
    for grp in plan.groups:
        assert not bool(plan._select(flat, fast_local, fast_values, grp, exact=False))
        plan._select(flat, exact_local, exact_values, grp, exact=True)
    assert torch.equal(fast_local, exact_local)
    assert torch.equal(fast_values, exact_values)
    assert any(grp.rows for grp in plan.groups) and plan.kept == fast_local.numel()


def test_a_non_finite_tensor_encodes_and_its_table_is_refused():
    """A NaN in one tensor (an attack, or an overflow) makes that tensor's table NaN, and the
    receivers refuse it; the encode does not stop (its codes read as 0, as the per-tensor
    codec's cast leaves them), and the other tensors' tables stay finite."""
    codec = make_codec("topk")
    ts = bucket(3)
    ts[2][0, 0] = float("nan")
    plan = TopKPlan(codec, [t.shape for t in ts], torch.device("cpu"))
    out = torch.zeros(plan.nbytes + 1, dtype=torch.uint8)
    plan.encode(torch.cat([t.reshape(-1) for t in ts]), out)
    assert bool(plan.decode(out[:-1])[2])
    stats = out[:-1][plan.stats_at].view(torch.float32).view(plan.tensors, -1)
    assert not bool(torch.isfinite(stats[2]).all()) and bool(torch.isfinite(stats[:2]).all())
    with pytest.raises(PayloadError, match="non-finite"):
        sparse_reference(codec, out[:-1], [t.shape for t in ts])


def test_a_strided_input_encodes_as_its_contiguous_copy(monkeypatch):
    monkeypatch.setenv("LOWCOMM_BATCH", "1")  # the codec's own single-tensor plan
    codec = make_codec("topk")
    x = torch.randn(128, 4)[:, 1]  # 128 values, stride 4: tiles read as rows of 64
    got, want = codec.encode(x), codec.encode(x.contiguous())
    assert torch.equal(got, want)
