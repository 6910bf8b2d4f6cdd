"""A codec's plan (codecs/base.py): the one implementation of every codec, over a bucket of
tensors at once. Checked against what does not depend on it: a bucket's payload is its tensors'
payloads back to back (a tensor's bytes do not depend on its bucket), a top-k selection is the
rule's (the k largest magnitudes, the lower index among equal ones, by a sort in Python), the
2-bit table is its formula in float64, and every rule a decoder checks sets the plan's flag."""

from __future__ import annotations

import pytest
import torch

from lowcomm.codecs import PayloadError, make_codec
from lowcomm.codecs.bitpack import Stream, Streams, pack_bits

#: a 2-D tile of 64 x 64, a 29-row one, 1 x 64 pieces, 0-d, empty, one element, 3-D, odd
SHAPES = [(96, 128), (128,), (87, 128), (), (0,), (1,), (5, 7, 64), (4096,), (3, 4), (64, 192)]
CODECS = [
    ("topk", {}),
    ("topk", {"value_codec": "fp32"}),
    ("topk", {"value_codec": "int8"}),
    ("topk", {"density": 0.5}),
    ("int8", {"block_size": 64}),
    ("int4", {}),
    ("int2", {"block_size": 32}),
    ("fp4", {}),
    ("fp32", {}),
    ("bf16", {}),
]


def bucket(seed: int = 0) -> list[torch.Tensor]:
    """Tensors of SHAPES with ties, whole numbers and zero rows (the tie rule's hard cases)."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g) for s in SHAPES]
    ts[0][3, :] = 0.5
    ts[0][5, 10:20] = -0.5
    ts[2] = torch.randint(-3, 4, ts[2].shape, generator=g).float()
    ts[9][:, :64] = 0.0
    return ts


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _encoded(codec, ts, at=None, width=None) -> tuple[torch.Tensor, object]:
    plan = codec.plan([t.shape for t in ts], torch.device("cpu"), at)
    out = torch.zeros((width or plan.span) + 1, dtype=torch.uint8)
    plan.encode(_flat(ts), out)
    return out, plan


@pytest.mark.parametrize("name,opts", CODECS)
def test_a_buckets_payload_is_its_tensors_payloads_back_to_back(name, opts):
    codec = make_codec(name, **opts)
    ts = bucket(1)
    out, plan = _encoded(codec, ts)
    assert torch.equal(out[:-1], torch.cat([codec.encode(t) for t in ts]))
    # laid out with gaps (a gathered fragment's flag bytes between its buckets): the same bytes
    gaps, at, pos = [], [], 0
    for t in ts:
        at.append(pos)
        pos += codec.nbytes(t.shape) + 3
        gaps.append(pos - 3)
    spaced, _ = _encoded(codec, ts, at, pos)
    for t, a in zip(ts, at):
        assert torch.equal(spaced[a : a + codec.nbytes(t.shape)], codec.encode(t))
    # and each decodes as the tensor's own payload does
    idx, values, bad = plan.decode(out)
    assert not bool(bad)
    dense = torch.zeros(plan.numel)
    if idx is None:
        dense = values
    else:
        dense.index_copy_(0, idx, values)
    want = _flat([codec.decode(codec.encode(t), t.shape) for t in ts])
    assert torch.equal(dense, want)
    if idx is None:  # a dense plan writes into a buffer, or adds to it, as the sum does
        base = torch.randn(plan.numel)
        into = base.clone()
        assert plan.decode(out, into=into, add=True)[1] is into
        assert torch.equal(into, base + want)
        assert torch.equal(plan.decode(out, into=into)[1], want)


def _rule_selection(x: torch.Tensor, k: int) -> list[int]:
    """The k largest magnitudes, the lower index among equal ones, in increasing index order,
    by sorting in Python (magnitudes compared as floats)."""
    order = sorted(range(len(x)), key=lambda i: (-abs(float(x[i])), i))
    return sorted(order[:k])


@pytest.mark.parametrize("density", [1 / 64, 1 / 8, 0.5])
def test_a_top_k_selection_is_the_rule_ties_included(density):
    codec = make_codec("topk", density=density)
    x = torch.randint(-2, 3, (64, 64)).float()  # whole numbers: ties in every tile
    x[7] = 0.0
    local, values = codec.select(x)
    g = codec.geometry(x.shape)
    tiles = x.view(g.R // g.tr, g.tr, g.ntj, g.tc).permute(0, 2, 1, 3).reshape(-1, g.L)
    for t in range(g.ntiles):
        want = _rule_selection(tiles[t], g.k)
        assert local[t].tolist() == want
        assert torch.equal(values[t], tiles[t][want])


def test_the_two_bit_table_is_its_formula():
    """shift = mean, width = 6 std / 4, codes by rounding, each bin's mean, in float64."""
    codec = make_codec("topk", density=1 / 8)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    _, values = codec.select(x)
    v = values.reshape(-1).double()
    shift = v.mean()
    m = (v - shift).abs().max()
    sigma = ((v - shift) / m).std() * m
    width = sigma.float() * (6.0 / 4)
    codes = ((v.float() - shift.float()) / width).add(2).round().clamp(0, 3).long()
    lut = [(v - shift)[codes == c].mean() for c in range(4)]
    got = codec.decode_sparse(codec.encode(x), x.shape)[1]
    want = torch.stack([lut[c] for c in codes]).float() + shift.float()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_streams_pack_like_pack_bits():
    values = torch.randint(0, 4096, (1000,))
    streams = [Stream(0, 300, 12, 0), Stream(300, 700, 3, 450), Stream(1000, 0, 5, 900)]
    out = torch.zeros(1200, dtype=torch.uint8)
    Streams(streams, torch.device("cpu")).pack(values, out, sink=1199)
    assert torch.equal(out[:450], pack_bits(values[:300], 12))
    assert torch.equal(out[450 : 450 + 263], pack_bits(values[300:] & 7, 3))
    got = Streams(streams, torch.device("cpu")).unpack(out, 1000)
    assert torch.equal(got[:300], values[:300]) and torch.equal(got[300:], values[300:] & 7)


def _broken(name: str, how: str) -> torch.Tensor:
    codec = make_codec(name)
    ts = [torch.randn(64, 64), torch.randn(300)]
    out, plan = _encoded(codec, ts)
    second = codec.nbytes(ts[0].shape)
    if how == "header":
        out[second + 3] ^= 1  # the codec id of the second tensor
    elif how == "scale":  # the second tensor's first scale (top-k: its table's shift) is NaN
        at = second + (32 if name == "topk" else 16)
        out[at : at + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    elif how == "index":  # top-k: every index of the second tensor past its tile
        out[second + codec._layout(codec.geometry(ts[1].shape))[1] : plan.span] = 0xFF
    return out


@pytest.mark.parametrize(
    "name,how,match",
    [
        ("int4", "header", "encoded with codec"),
        ("int4", "scale", "invalid scale"),
        ("fp4", "scale", "invalid scale"),
        ("topk", "header", "encoded with codec"),
        ("topk", "scale", "non-finite shift or lookup table"),
        ("topk", "index", "top-k index out of range"),
    ],
)
def test_every_rule_a_decoder_checks_sets_the_flag_and_names_the_tensor(name, how, match):
    codec = make_codec(name)
    out = _broken(name, how)
    shapes = [torch.Size([64, 64]), torch.Size([300])]
    plan = codec.plan(shapes, torch.device("cpu"))
    assert bool(plan.decode(out)[2])
    with pytest.raises(PayloadError, match=match) as err:
        plan.explain(out, ["first", "second"])
    assert "second" in str(err.value)


def test_invalid_codes_are_flagged():
    """int-k's code 0 and FP4's negative zero are not the format's."""
    for name, code in (("int4", 0x00), ("fp4", 0x88)):
        codec = make_codec(name)
        p = codec.encode(torch.randn(512))
        p[-10] = code
        assert bool(codec.plan([torch.Size([512])], torch.device("cpu")).decode(p)[2])
        with pytest.raises(PayloadError, match="outside the format"):
            codec.decode(p, torch.Size([512]))


@pytest.mark.parametrize("name", ["int8", "fp4", "topk", "fp32"])
def test_a_bucket_of_empty_tensors_is_its_headers(name):
    codec = make_codec(name)
    ts = [torch.empty(0), torch.empty(0, 3)]
    out, plan = _encoded(codec, ts)
    assert plan.span == 32 and torch.equal(out[:-1], torch.cat([codec.encode(t) for t in ts]))
    assert plan.decode(out)[1].numel() == 0


def test_stochastic_rounding_is_unbiased_on_the_plan():
    codec = make_codec("int4", stochastic=True, generator=torch.Generator().manual_seed(0))
    x = torch.full((64, 256), 0.3)
    x[:, 0] = 1.0  # each block's absmax 1: 0.3 lies between the codes 2/7 and 3/7
    mean = sum(codec.roundtrip(x) for _ in range(50)) / 50
    assert abs(float(mean[:, 1:].mean()) - 0.3) < 2e-3
