"""Codecs: error bounds, exact sizes, top-k selection, bit packing and hostile payloads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowcomm.codecs import CODEC_NAMES, Codec, PayloadError, make_codec
from lowcomm.codecs.bitpack import (
    bits_for,
    pack_bits,
    pack_planar,
    packed_nbytes,
    planar_nbytes,
    unpack_bits,
    unpack_planar,
)
from lowcomm.codecs.block import MIN_SCALE
from lowcomm.codecs.lut import LutCodec
from lowcomm.codecs.topk import largest_divisor

PROP = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
ALL = list(CODEC_NAMES)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# ---- data --------------------------------------------------------------------------------------

shapes = st.one_of(
    st.just(()),
    st.tuples(st.integers(0, 3000)),
    st.tuples(st.integers(0, 150), st.integers(0, 150)),
    st.tuples(st.integers(1, 9), st.integers(1, 13), st.integers(1, 17)),
    st.sampled_from([(1,), (1, 1), (64, 64), (128, 192), (67, 131), (4097,), (20000,), (300, 257)]),
)
kinds = st.sampled_from(["normal", "heavy", "sparse", "const", "zeros", "tiny", "huge", "ints"])


def make_tensor(shape, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x * torch.rand(shape, generator=g).pow(-2.0)  # heavy tails
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=g) < 0.05)
    elif kind == "const":
        x = torch.full(shape, 0.37)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "huge":
        x = x * 1e30
    elif kind == "ints":
        x = torch.randint(-4, 5, shape, generator=g).float()
    return x


tensors = st.builds(make_tensor, shapes, kinds, st.integers(0, 2**31 - 1))


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the absmax of its block (independent of the codec's code)."""
    flat = x.reshape(-1)
    n = flat.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block)
    pad[:n] = flat.abs()
    s = pad.view(nb, block).amax(1).clamp(min=MIN_SCALE)
    return s.repeat_interleave(block)[:n].view(x.shape)


# ---- registry ----------------------------------------------------------------------------------


def test_registry_names_and_errors():
    for name in CODEC_NAMES:
        c = make_codec(name)
        assert isinstance(c, Codec)
    assert make_codec("loco").name == "int4"
    assert make_codec("topk").elementwise is False
    with pytest.raises(ValueError, match="fp32.*topk"):
        make_codec("int3")
    with pytest.raises(ValueError, match="unknown codec option"):
        make_codec("int4", blocksize=64)
    # a config may pass every knob; those of other codecs are ignored
    c = make_codec("int4", block_size=64, density=0.01, value_bits=2)
    assert c.block_size == 64
    assert make_codec("topk", density=1 / 32, block_size=None).density == 1 / 32


def test_registry_declarations_match_the_classes_and_the_wire():
    """Each @register is what its class does; the wire ids are the format's (never renumber)."""
    from lowcomm.codecs import specs
    from lowcomm.codecs._format import codec_ids
    from lowcomm.lab import int4_authors  # noqa: F401  (the lab's codec, id 10)

    assert codec_ids().items() >= {
        "fp32": 1, "bf16": 2, "fp16": 3, "int8": 4, "int4": 5, "int2": 6, "fp4": 7,
        "topk": 8, "lut": 9, "int4-authors": 10,
    }.items()  # fmt: skip
    for name in CODEC_NAMES:
        spec, c = specs()[name], make_codec(name)
        assert c.name == (spec.alias_of or name)
        assert c.elementwise is spec.elementwise
        assert spec.sparse is hasattr(c, "decode_sparse")
        assert not spec.dense or isinstance(c.dtype, torch.dtype)  # allreduce sums in it
    assert "lut" not in CODEC_NAMES  # a building block: no codec=lut


def test_config_choices_come_from_the_registry():
    from lowcomm.config import CODECS, DENSE_CODECS, ConfigError, SyncConfig

    assert CODECS == CODEC_NAMES and DENSE_CODECS == ("fp32", "bf16", "fp16")
    assert all(name in SyncConfig.__dataclass_fields__["codec"].metadata["help"] for name in CODECS)
    with pytest.raises(ConfigError, match="unknown codec 'int3': choose one of fp32, bf16"):
        SyncConfig(codec="int3")
    with pytest.raises(ConfigError, match="codec must be one of fp32"):
        SyncConfig(codec=4)
    with pytest.raises(ConfigError, match="two-phase needs an element-wise codec"):
        SyncConfig(codec="topk", reduce="two-phase")
    assert SyncConfig(codec="topk").resolved_aggregation == "selected-mean"


# ---- sizes -------------------------------------------------------------------------------------


@PROP
@given(x=tensors, name=st.sampled_from(ALL))
def test_payload_size_is_nbytes_and_roundtrips(x, name):
    c = make_codec(name)
    p = c.encode(x)
    assert p.dtype == torch.uint8 and p.dim() == 1
    assert p.numel() == c.nbytes(x.shape)
    y = c.decode(p, x.shape, "w")
    assert y.shape == x.shape and y.dtype == torch.float32
    if name != "fp16":  # fp16 overflows to inf beyond 65504, as IEEE conversion does
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4)])
def test_empty_tensors(name, shape):
    c = make_codec(name)
    x = torch.empty(shape)
    p = c.encode(x)
    assert p.numel() == c.nbytes(shape) <= 64  # header (+ a constant table for top-k values)
    assert c.decode(p, shape).shape == torch.Size(shape)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(1 << 20,), (1024, 1024), (1000, 1049)])
def test_wire_bits_match_formula_for_large_tensors(name, shape):
    c = make_codec(name)
    x = torch.randn(shape)
    p = c.encode(x)
    n = x.numel()
    wire = 8 * p.numel() / n
    formula = c.formula_bits_per_param(x.shape)
    assert abs(wire - formula) <= 0.01 * formula, (wire, formula)


def test_formulas():
    assert make_codec("int4").formula_bits_per_param((1 << 20,)) == 4 + 32 / 256
    assert make_codec("fp4", block_size=128).formula_bits_per_param((1 << 20,)) == 4.25
    t = make_codec("topk")
    assert t.formula_bits_per_param((4096, 4096)) == pytest.approx(64 / 4096 * 14)
    assert t.formula_bits_per_param((4096,)) == pytest.approx(1 / 64 * (6 + 2))
    assert make_codec("bf16").formula_bits_per_param((3,)) == 16


# ---- dense -------------------------------------------------------------------------------------


@PROP
@given(x=tensors)
def test_fp32_exact(x):
    c = make_codec("fp32")
    assert torch.equal(c.roundtrip(x), x)


@PROP
@given(x=tensors, name=st.sampled_from(["bf16", "fp16"]))
def test_half_formats_round_to_nearest_and_are_exact_when_representable(x, name):
    dt = torch.bfloat16 if name == "bf16" else torch.float16
    c = make_codec(name)
    assert torch.equal(c.roundtrip(x), x.to(dt).float())
    rep = x.to(dt).float()
    if torch.isfinite(rep).all():
        assert torch.equal(c.roundtrip(rep), rep)


def test_fp32_keeps_nan_and_inf():
    x = torch.tensor([float("nan"), float("inf"), -1.5])
    y = make_codec("fp32").roundtrip(x)
    assert torch.isnan(y[0]) and y[1] == float("inf") and y[2] == -1.5


# ---- uniform -----------------------------------------------------------------------------------


@PROP
@given(
    x=tensors,
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([1, 7, 64, 256, 1000]),
    stochastic=st.booleans(),
)
def test_uniform_error_bound(x, bits, block, stochastic):
    c = make_codec(f"int{bits}", block_size=block, stochastic=stochastic)
    y = c.roundtrip(x)
    qmax = 2 ** (bits - 1) - 1
    s = block_absmax(x, block)
    bound = s / qmax * (1.0 if stochastic else 0.5)
    assert ((y - x).abs() <= bound * (1 + 1e-5) + 1e-37).all()
    # values decode onto the grid s * q / qmax, |q| <= qmax
    q = y / (s / qmax)
    assert (q.abs() <= qmax * (1 + 1e-5)).all()
    assert torch.allclose(q, q.round(), atol=1e-3)


def test_uniform_stochastic_is_unbiased():
    x = torch.linspace(-1, 1, 512)
    c = make_codec(
        "int4", block_size=512, stochastic=True, generator=torch.Generator().manual_seed(0)
    )
    mean = torch.stack([c.roundtrip(x) for _ in range(400)]).mean(0)
    assert (mean - x).abs().max() < 0.03  # step 1/7, std of mean < 0.036/2
    assert (mean - x).abs().mean() < 0.008


def test_uniform_round_to_nearest_values():
    x = torch.tensor([7.0, 3.4, 3.6, -7.0, 0.0, -0.4])
    y = make_codec("int4", block_size=6).roundtrip(x)
    assert torch.equal(y, torch.tensor([7.0, 3.0, 4.0, -7.0, 0.0, 0.0]))
    y = make_codec("int2", block_size=6).roundtrip(x)
    assert torch.equal(y, torch.tensor([7.0, 0.0, 7.0, -7.0, 0.0, 0.0]))


# ---- the LoCo authors' int4 --------------------------------------------------------------------


def test_authors_int4_values_half_to_even_and_top_clipped():
    # absmax 8: scale 1; halves go to the even code; +8 is clipped to 7, -8 is a code
    x = torch.tensor([0.5, 1.5, 2.5, -2.5, 3.49, -8.0, 8.0, 7.6])
    y = make_codec("int4-authors", block_size=8).roundtrip(x)
    assert torch.equal(y, torch.tensor([0.0, 2.0, 2.0, -2.0, 3.0, -8.0, 7.0, 7.0]))


@PROP
@given(x=tensors, block=st.sampled_from([1, 5, 32, 256]))
def test_authors_int4_matches_its_formula(x, block):
    """Per group: s = absmax / 8, q = clamp(round(x / s), -8, 7), x' = q s."""
    flat = x.reshape(-1).float()
    want = torch.empty_like(flat)
    for i in range(0, flat.numel(), block):
        g = flat[i : i + block]
        s = g.abs().amax().clamp(min=2.0**-100) / 8
        want[i : i + block] = torch.clamp(torch.round(g / s), -8, 7) * s
    got = make_codec("int4-authors", block_size=block).roundtrip(x).reshape(-1)
    assert torch.equal(got, want)


def test_authors_group_size_is_min_rows_cols():
    from lowcomm.hooks.loco_common import authors_group_size

    assert authors_group_size((768, 3072), 128) == 768
    assert authors_group_size((3072, 768), 128) == 768
    assert authors_group_size((64, 3, 3, 3), 128) == 27  # a conv kernel: rows x (in * kh * kw)
    assert authors_group_size((100,), 128) == 128 and authors_group_size((), 16) == 16


# ---- fp4 ---------------------------------------------------------------------------------------


@PROP
@given(x=tensors, block=st.sampled_from([1, 3, 64, 256]))
def test_fp4_nearest_code_and_bound(x, block):
    c = make_codec("fp4", block_size=block)
    y = c.roundtrip(x)
    s = block_absmax(x, block)
    assert ((y - x).abs() <= torch.maximum(x.abs() / 3, s / 128) * (1 + 1e-5) + 1e-37).all()
    # y is the nearest point of the codebook {0, +-s 2^-j, j = 0..6}
    mags = torch.cat([torch.zeros(1), 2.0 ** -torch.arange(7.0)])
    book = torch.cat([mags, -mags[1:]])  # (15,)
    cand = s.reshape(-1, 1) * book  # (n, 15)
    best = (cand - x.reshape(-1, 1)).abs().amin(1)
    assert ((y - x).abs().reshape(-1) <= best * (1 + 1e-5) + 1e-37).all()
    r = (y.reshape(-1) / s.reshape(-1)).abs()
    on_book = (r.reshape(-1, 1) - mags).abs().amin(1) <= 1e-6
    assert on_book.all()


@PROP
@given(x=tensors)
def test_fp4_stochastic_bound(x):
    c = make_codec("fp4", block_size=64, stochastic=True)
    y = c.roundtrip(x)
    s = block_absmax(x, 64)
    assert ((y - x).abs() <= torch.maximum(x.abs(), s / 64) * (1 + 1e-5) + 1e-37).all()


def test_fp4_stochastic_is_unbiased():
    x = torch.cat([torch.tensor([1.0]), torch.linspace(-0.9, 0.9, 255)])
    c = make_codec(
        "fp4", block_size=256, stochastic=True, generator=torch.Generator().manual_seed(1)
    )
    mean = torch.stack([c.roundtrip(x) for _ in range(400)]).mean(0)
    assert (mean - x).abs().mean() < 0.01


def test_fp4_codebook_exact():
    x = torch.tensor(
        [1.0, 0.5, -0.25, 2.0**-6, -(2.0**-6), 0.0, 0.74, 0.76, 2.0**-7 * 0.99, 2.0**-7]
    )
    y = make_codec("fp4", block_size=16).roundtrip(x)
    want = torch.tensor([1.0, 0.5, -0.25, 2.0**-6, -(2.0**-6), 0.0, 0.5, 1.0, 0.0, 2.0**-6])
    assert torch.equal(y, want)


# ---- top-k -------------------------------------------------------------------------------------


def tiles_of(x: torch.Tensor):
    """Independent tiling: list of (flat indices) per tile, row-major tile order."""
    n = x.numel()
    if n == 0:
        return []
    if x.dim() >= 2:
        R, C = x.shape[0], n // x.shape[0]
    else:
        R, C = 1, n
    tr, tc = largest_divisor(R), largest_divisor(C)
    grid = torch.arange(n).view(R, C)
    out = []
    for i in range(R // tr):
        for j in range(C // tc):
            out.append(grid[i * tr : (i + 1) * tr, j * tc : (j + 1) * tc].reshape(-1))
    return out


def test_largest_divisor():
    assert largest_divisor(130) == 26 and largest_divisor(128) == 64 and largest_divisor(67) == 1
    assert largest_divisor(4097) == 17 and largest_divisor(1) == 1 and largest_divisor(63) == 63


@PROP
@given(x=tensors, density=st.sampled_from([1 / 64, 1 / 32, 0.1, 0.5, 1.0]))
def test_topk_keeps_exactly_the_k_largest_per_chunk(x, density):
    c = make_codec("topk", density=density, value_codec="fp32")
    p = c.encode(x)
    idx, vals = c.decode_sparse(p, x.shape, "w")
    flat = x.reshape(-1)
    tiles = tiles_of(x)
    assert idx.numel() == sum(max(1, min(t.numel(), round(t.numel() * density))) for t in tiles)
    assert torch.equal(vals, flat[idx])  # fp32 values: exact
    pos = 0
    for t in tiles:
        k = min(t.numel(), max(1, round(t.numel() * density)))
        got = idx[pos : pos + k]
        pos += k
        assert set(got.tolist()) <= set(t.tolist()) and len(set(got.tolist())) == k
        want = flat[t].abs().sort(descending=True).values[:k]
        assert torch.equal(flat[got].abs().sort(descending=True).values, want)
    y = c.decode(p, x.shape)
    dense = torch.zeros(flat.numel())
    dense[idx] = flat[idx]
    assert torch.equal(y.reshape(-1), dense)


def lut_reference(v: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Independent few-line computation of the LUT codec's decode (docs/algorithms.md §3 step 3)."""
    L = 2**bits
    if v.numel() == 0:
        return v.clone()
    shift = v.mean()
    c = v - shift
    m = float(c.abs().max())
    sigma = (c / m).std() * m if v.numel() > 1 and m > 0 else torch.tensor(0.0)
    width = sigma * 6 / L if sigma > 0 else torch.tensor(1.0)
    codes = torch.clamp(torch.round(c / width + L // 2), 0, L - 1).long()
    out = torch.empty_like(v)
    for j in range(L):
        m = codes == j
        if m.any():
            out[m] = c[m].mean() + shift
    return out


@PROP
@given(x=tensors)
def test_topk_default_values_are_2bit_lut(x):
    c = make_codec("topk")
    p = c.encode(x)
    idx, vals = c.decode_sparse(p, x.shape)
    want = lut_reference(x.reshape(-1)[idx])
    assert torch.allclose(
        vals, want, rtol=1e-4, atol=1e-6 * (float(want.abs().max()) if want.numel() else 0)
    )


@PROP
@given(v=tensors, bits=st.sampled_from([1, 2, 3, 4, 8]))
def test_lut_codec_matches_reference(v, bits):
    v = v.reshape(-1)
    c = LutCodec(bits)
    y = c.roundtrip(v)
    want = lut_reference(v, bits)
    tol = 1e-5 * float(v.abs().max()) if v.numel() else 0.0
    assert torch.allclose(y, want, rtol=1e-4, atol=tol)


def test_lut_guards():
    c = LutCodec(2)
    assert torch.equal(c.roundtrip(torch.tensor([3.5])), torch.tensor([3.5]))
    assert torch.equal(c.roundtrip(torch.full((10,), -2.0)), torch.full((10,), -2.0))
    # +-1: sigma = sqrt(2), width = 2.12, both land in bin 2 (the reference's binning)
    assert torch.equal(c.roundtrip(torch.tensor([-1.0, 1.0])), torch.zeros(2))
    # sigma = sqrt(5), width = 3.35: codes 1, 2, 2, 2, 3
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 3.0])
    assert torch.equal(c.roundtrip(x), torch.tensor([-3.0, 0.0, 0.0, 0.0, 3.0]))
    x = torch.tensor([-10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0])  # clamped to 0 and 3
    y = c.roundtrip(x)
    assert y[0] == -10.0 and y[-1] == 9.0


@pytest.mark.parametrize("vc", ["bf16", "int8", "fp4", "int4"])
def test_topk_with_other_value_codecs(vc):
    x = torch.randn(256, 320)
    c = make_codec("topk", value_codec=vc, density=1 / 16)
    p = c.encode(x)
    assert p.numel() == c.nbytes(x.shape)
    idx, vals = c.decode_sparse(p, x.shape)
    assert torch.allclose(vals, make_codec(vc).roundtrip(x.reshape(-1)[idx]))


def test_topk_geometry_examples():
    c = make_codec("topk")
    g = c.geometry((4096, 4096))
    assert (g.tr, g.tc, g.L, g.k, g.index_bits, g.ntiles) == (64, 64, 4096, 64, 12, 4096)
    g = c.geometry((1000,))
    assert (g.tr, g.tc, g.k, g.index_bits) == (1, 50, 1, 6)
    g = c.geometry((8, 3, 5))  # first dim x rest: 8 x 15
    assert (g.R, g.C, g.tr, g.tc) == (8, 15, 8, 15)
    g = c.geometry(())
    assert (g.L, g.k, g.index_bits) == (1, 1, 0)


# ---- bit packing -------------------------------------------------------------------------------


@PROP
@given(n=st.integers(0, 5000), bits=st.integers(0, 16), seed=st.integers(0, 1000))
def test_pack_bits_roundtrip(n, bits, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 2**bits, (n,), generator=g) if bits else torch.zeros(n, dtype=torch.int64)
    p = pack_bits(v, bits)
    assert p.numel() == packed_nbytes(n, bits)
    assert abs(8 * p.numel() - n * bits) < 8 * 4  # at most a partial byte per bit slice
    assert torch.equal(unpack_bits(p, bits, n), v)


@PROP
@given(n=st.integers(0, 3000), bits=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 1000))
def test_planar_roundtrip_and_layout(n, bits, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 2**bits, (n,), generator=g).to(torch.uint8)
    p = pack_planar(v, bits)
    assert p.numel() == planar_nbytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_planar(p, bits, n), v)
    if bits == 4 and n >= 512:  # documented layout: byte i = code i | code i+256 << 4
        assert int(p[3]) == int(v[3]) | int(v[259]) << 4


def test_bits_for():
    assert [bits_for(n) for n in (1, 2, 3, 4, 5, 64, 4096, 4097)] == [0, 1, 2, 2, 3, 6, 12, 13]


# ---- hostile payloads --------------------------------------------------------------------------

TAMPER_SHAPE = (67, 131)


def encoded(name: str, **opts):
    c = make_codec(name, **opts)
    x = torch.randn(TAMPER_SHAPE, generator=torch.Generator().manual_seed(3))
    return c, c.encode(x).clone()


@pytest.mark.parametrize("name", ALL)
def test_truncated_and_extended_payloads_raise(name):
    c, p = encoded(name)
    with pytest.raises(PayloadError, match="layer.0.w.*bytes"):
        c.decode(p[:-1], TAMPER_SHAPE, "layer.0.w")
    with pytest.raises(PayloadError, match="layer.0.w"):
        c.decode(torch.cat([p, torch.zeros(1, dtype=torch.uint8)]), TAMPER_SHAPE, "layer.0.w")
    with pytest.raises(PayloadError):
        c.decode(p.float(), TAMPER_SHAPE)
    with pytest.raises(PayloadError):
        c.decode(p, (67, 130))  # wrong shape


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(
    "byte,what", [(0, "magic"), (2, "version"), (3, "codec"), (4, "parameter"), (8, "elements")]
)
def test_corrupted_header_raises(name, byte, what):
    c, p = encoded(name)
    p[byte] ^= 0x01
    with pytest.raises(PayloadError, match="emb"):
        c.decode(p, TAMPER_SHAPE, "emb")


def test_payload_from_another_codec_raises():
    _, p = encoded("int4")
    with pytest.raises(PayloadError, match="int4"):
        make_codec("fp4").decode(p, TAMPER_SHAPE)
    # same size (one block either way), different block size in the header
    x = torch.randn(100)
    p = make_codec("int4", block_size=128).encode(x)
    with pytest.raises(PayloadError, match="parameter 128"):
        make_codec("int4", block_size=256).decode(p, x.shape)


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_scales_raise(name, bad):
    c, p = encoded(name)
    scales = p[16:20].view(torch.float32)
    scales[0] = bad
    with pytest.raises(PayloadError, match="w1.*scale"):
        c.decode(p, TAMPER_SHAPE, "w1")


@pytest.mark.parametrize(
    "name,byte_value",
    [("int8", 0), ("int4", 0x80), ("int4", 0x08), ("int2", 0xE4 & 0xFC), ("fp4", 0x18)],
)
def test_out_of_range_codes_raise(name, byte_value):
    c, p = encoded(name)
    p[-5] = byte_value
    with pytest.raises(PayloadError, match="w2.*range"):
        c.decode(p, TAMPER_SHAPE, "w2")


def test_topk_bad_indices_raise():
    # 3 x 5 tile: L = 15 addressed with 4 bits, so index 15 is out of range
    c = make_codec("topk", density=0.2)
    x = torch.randn(3, 5)
    g = c.geometry(x.shape)
    assert (g.L, g.k, g.index_bits) == (15, 3, 4)
    p = c.encode(x).clone()
    idx_at = 16 + c.value_codec.nbytes((g.K,))
    # 3 indices of 4 bits, planar: byte 0 = idx0 | idx2 << 4, byte 1 = idx1
    p[idx_at + 1] = 15
    with pytest.raises(PayloadError, match="head.*out of range"):
        c.decode(p, x.shape, "head")
    p = c.encode(x).clone()
    p[idx_at + 1] = p[idx_at] & 0x0F  # idx1 == idx0: duplicate
    with pytest.raises(PayloadError, match="head.*increasing"):
        c.decode_sparse(p, x.shape, "head")


def test_topk_nan_value_table_raises():
    c, p = encoded("topk")
    p[16 + 16 : 16 + 20].view(torch.float32)[0] = float("nan")  # the value codec's shift
    with pytest.raises(PayloadError, match="bias.*top-k values.*non-finite"):
        c.decode(p, TAMPER_SHAPE, "bias")


def test_non_finite_input_is_caught_by_the_receiver():
    x = torch.randn(1000)
    x[10] = float("nan")
    for name in ["int8", "int4", "fp4", "topk"]:
        c = make_codec(name)
        with pytest.raises(PayloadError):
            c.decode(c.encode(x), x.shape)


@pytest.mark.parametrize("name", ALL)
def test_misaligned_payload_decodes(name):
    c, p = encoded(name)
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), p])
    x = c.decode(p, TAMPER_SHAPE)
    assert torch.equal(c.decode(buf[3:], TAMPER_SHAPE), x)


def test_bf16_input_and_noncontiguous_input():
    x = torch.randn(40, 70)
    for name in ["int4", "fp4", "topk", "fp32"]:
        c = make_codec(name)
        assert torch.equal(c.roundtrip(x.t()), c.roundtrip(x.t().contiguous()))
        c.roundtrip(x.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL)
def test_devices_agree(device, name):
    x = torch.randn(300, 257)
    c = make_codec(name)
    p = c.encode(x.to(device))
    assert p.device.type == device
    y = c.decode(p, x.shape)
    assert y.device.type == device
    if name == "topk":  # same selection; the 2-bit table's float sums may differ in the last bit
        i_dev, v_dev = c.decode_sparse(p, x.shape)
        i_cpu, v_cpu = c.decode_sparse(c.encode(x), x.shape)
        assert torch.equal(i_dev.cpu(), i_cpu)
        assert torch.allclose(v_dev.cpu(), v_cpu, rtol=1e-4, atol=1e-5)
    else:  # bit-identical payloads on every device
        assert torch.equal(p.cpu(), c.encode(x))
        assert torch.equal(y.cpu(), c.roundtrip(x))
