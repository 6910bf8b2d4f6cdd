"""The kernels behind the codecs' plans (codecs/kernels.py): every implementation gives its
torch reference's bits (C's on this machine; Triton's under its interpreter where Triton is
installed, compiled on a GPU), :func:`choose` is the one place the choice is made, and
``kernels=torch`` runs the references alone, to the same bits through whole runs of the engine
on real gloo workers."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import adamw, batches, flat_params, local_steps, tiny_model

import lowcomm
from lowcomm.codecs import _native, kernels, make_codec
from lowcomm.engine.tensors import views

HAS_C = _native.lib() is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
needs_c = pytest.mark.skipif(not HAS_C, reason="no C compiler here")
needs_triton = pytest.mark.skipif(
    not (kernels.TRITON and (torch.cuda.is_available() or INTERPRETED)),
    reason="Triton is not installed, or no GPU and its interpreter is off",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(256, 320), (513,), (7, 3, 65), (1,), (64, 64), (3,), (4096,), (0,)]


def _with_ties(shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    flat[::5] = 0.5  # many equal magnitudes, of both signs
    flat[1::10] = -0.5
    flat[2::13] = 0.0
    return x


def _selected(plan, flat: torch.Tensor, impl) -> tuple[torch.Tensor, torch.Tensor]:
    local = torch.empty(plan.kept, dtype=torch.int64, device=flat.device)
    values = torch.empty(plan.kept, dtype=torch.float32, device=flat.device)
    for tiles in plan.groups:
        impl(flat, tiles, local, values)
    return local, values


def test_the_choice_is_made_in_one_place():
    cpu = kernels.choose(torch.device("cpu"))
    want = "c" if HAS_C else "torch"
    ops = ("select", "quantize", "dequantize", "decode_packed", "pack", "unpack", "scan")
    ops = (*ops, "pack_streams")
    ops = (*ops, "unpack_streams", "difference")
    assert cpu.names == dict.fromkeys(ops, want)
    assert set(kernels.choose(torch.device("cpu"), "torch").names.values()) == {"torch"}
    with pytest.raises(ValueError, match="kernels='triton': choose one of auto, torch"):
        kernels.choose(torch.device("cpu"), "triton")
    with pytest.raises(lowcomm.ConfigError, match="unknown kernels 'c'"):
        lowcomm.SyncConfig(kernels="c")
    # the setting reaches every codec a config builds
    from lowcomm.aggregate import make_aggregator

    agg = make_aggregator(lowcomm.SyncConfig(codec="topk", kernels="torch"), 2)
    assert agg.codec.kernels == "torch"
    plan = agg.codec.plan([torch.Size([64, 64])], torch.device("cpu"))
    assert set(plan.kernels.names.values()) == {"torch"}


@needs_c
@pytest.mark.parametrize("density", [1 / 64, 1 / 32, 0.5])
def test_c_selection_is_the_references_bits_ties_zeros_and_non_finite_included(density):
    codec = make_codec("topk", density=density)
    ts = [_with_ties(s, i) for i, s in enumerate(SHAPES)]
    ts[0][3, 5:9] = float("inf")  # more equal maxima than kept
    ts[1][100] = float("nan")  # counts as the largest magnitude
    flat = torch.cat([t.reshape(-1) for t in ts])
    plan = codec.plan([t.shape for t in ts], torch.device("cpu"))
    ref = _selected(plan, flat, kernels.select_torch)
    got = _selected(plan, flat, kernels.select_c)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1].view(torch.int32), ref[1].view(torch.int32))  # NaN's bits too


@needs_c
@pytest.mark.parametrize("snapshot", [False, True])
def test_c_difference_is_the_references_bits_and_finite_check(snapshot):
    params = [torch.randn(s) for s in SHAPES]
    reference = torch.randn(sum(p.numel() for p in params))
    for bad in (None, float("nan"), float("-inf")):
        if bad is not None:
            params[2].view(-1)[4] = bad
        got, want = [], []
        for impl in (kernels.difference_c, kernels.difference_torch):
            ref = reference.clone()
            out = torch.empty_like(ref)
            snaps = views(ref, params) if snapshot else None  # the snapshot is the reference
            finite = impl(views(out, params), views(ref, params), params, snaps)
            assert finite.dim() == 0 and finite.dtype == torch.bool
            (got if impl is kernels.difference_c else want).append((out, ref, bool(finite)))
        (o1, r1, f1), (o2, r2, f2) = got[0], want[0]
        assert torch.equal(o1.view(torch.int32), o2.view(torch.int32))
        assert torch.equal(r1.view(torch.int32), r2.view(torch.int32))
        assert f1 == f2 == (bad is None)


def _near_ties(qmax: int, blocks: int = 8) -> torch.Tensor:
    """Blocks of 64 (absmax first) holding an element whose code is a tie broken by the last
    bit of ``qmax / s``: torch computes it as ``(1 / s) * qmax``, a division misses it (the
    one element of a run's 43k that told a C kernel from the reference)."""
    g = torch.Generator().manual_seed(qmax)
    s = torch.rand(1 << 16, generator=g) * 1e-3 + 1e-6
    inv = (1 / s) * qmax
    s = s[inv != torch.full_like(s, float(qmax)) / s]
    half = torch.randint(0, max(qmax, 1), s.shape, generator=g) + 0.5
    x = half / ((1 / s) * qmax)
    for step in (0, 1, -1, 2, -2):  # the tie's neighbours in the last bits
        y = x + step * torch.finfo(torch.float32).eps * x
        a, b = torch.round(y * ((1 / s) * qmax)), torch.round(y * (qmax / s.double()).float())
        if (a != b).sum() >= blocks:
            x = y
            break
    pick = torch.round(x * ((1 / s) * qmax)) != torch.round(x * (qmax / s.double()).float())
    out = torch.zeros(blocks, 64)
    out[:, 0], out[:, 1] = s[pick][:blocks], x[pick][:blocks]
    return out


def _block_bucket(name: str, device: str = "cpu"):
    """A bucket of tensors of every scale, zeros, whole and short blocks, partial planar groups,
    and codes at ties that the last bit of the scale's reciprocal breaks."""
    codec = make_codec(name, block_size=64)
    ts = [torch.randn(s) for s in [(700,), (64, 33), (5,), (4096,), (64, 64)]]
    if name in ("int8", "int4"):  # (int2's qmax is 1: its reciprocal is exact)
        ts.append(_near_ties(codec.qmax))
    ts[3] *= torch.logspace(-30, 4, 4096)
    ts[4][3] = 0.0
    ts[4][5, 7] = -ts[4][5].abs().max() * 2  # the absmax on a negative entry
    flat = torch.cat([t.reshape(-1) for t in ts]).to(device)
    return codec, codec.plan([t.shape for t in ts], torch.device(device)), flat


@needs_c
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp4"])
def test_c_block_kernels_are_the_references_bits(name):
    """Quantise, dequantise (and add), pack and unpack: C against torch, bit for bit, on tensors
    of whole and short blocks read at their places."""
    codec, plan, flat = _block_bucket(name)
    got = (torch.empty(plan.blocks), torch.empty(plan.blocks * 64, dtype=torch.uint8))
    want = (torch.empty(plan.blocks), torch.empty(plan.blocks * 64, dtype=torch.uint8))
    kernels.quantize_c(plan, flat, *got)
    kernels.quantize_torch(plan, flat, *want)
    assert torch.equal(got[0], want[0])
    real = torch.ones(plan.blocks * 64, dtype=torch.bool)
    real[plan.pad_at] = False  # a short block's missing codes: never packed
    assert torch.equal(got[1][real], want[1][real])
    scales, codes = want
    for add in (False, True):
        out_c, out_t = torch.ones(plan.numel), torch.ones(plan.numel)
        bad_c = kernels.dequantize_c(plan, codes, scales, out_c, add)
        bad_t = kernels.dequantize_torch(plan, codes, scales, out_t, add)
        assert torch.equal(out_c, out_t) and bool(bad_c) == bool(bad_t) is False
    broken = codes.clone()
    broken[100] = 0 if name != "fp4" else 8  # a code outside the format
    assert bool(kernels.dequantize_c(plan, broken, scales, torch.empty(plan.numel)))
    # the values straight from the packed payload, written and added
    if plan.per > 1:
        payload = torch.zeros(plan.span + 1, dtype=torch.uint8)
        plan.encode(flat, payload)
        for add in (False, True):
            out_c, out_t = torch.ones(plan.numel), torch.ones(plan.numel)
            bad_c = kernels.decode_packed_c(plan, payload, scales, out_c, add)
            bad_t = kernels.decode_packed_torch(plan, payload, scales, out_t, add)
            assert torch.equal(out_c, out_t) and bool(bad_c) == bool(bad_t) is False
    # the scan of the packed payload: none found, then each tensor's last code broken
    payload = torch.zeros(plan.span + 1, dtype=torch.uint8)
    plan.encode(flat, payload)
    assert not bool(kernels.scan_c(plan, payload)) and not bool(kernels.scan_torch(plan, payload))
    for b0, n, at in zip(*(r.tolist() for r in plan.runs)):
        if not n:
            continue
        spoiled = payload.clone()
        if plan.per == 1:  # one code a byte, where the tensor's codes lie
            spoiled[at + n - 1] = codec.bad_code
        else:
            one = codes.clone()
            one[b0 + n - 1] = codec.bad_code
            kernels.pack_torch(plan, one, spoiled)
        assert bool(kernels.scan_c(plan, spoiled)) and bool(kernels.scan_torch(plan, spoiled))
    if plan.per > 1:
        out_c = torch.zeros(plan.span + 1, dtype=torch.uint8)
        out_t = torch.zeros_like(out_c)
        kernels.pack_c(plan, codes, out_c)
        kernels.pack_torch(plan, codes, out_t)
        assert torch.equal(out_c, out_t)
        back_c, back_t = torch.zeros_like(codes), torch.zeros_like(codes)
        kernels.unpack_c(plan, out_c, back_c)
        kernels.unpack_torch(plan, out_c, back_t)
        assert torch.equal(back_c, back_t)


@needs_c
def test_c_streams_are_the_references_bytes_and_values():
    """Streams of every width the codecs use (a 2-bit table's codes, top-k's 6 to 18-bit
    indices, whole and partial planar groups): C packs the reference's bytes (and nothing past
    a segment) and unpacks its values."""
    from lowcomm.codecs.bitpack import Stream, Streams

    g = torch.Generator().manual_seed(3)
    streams, first, at = [], 0, 0
    for bits, count in [(2, 5000), (12, 3000), (18, 700), (6, 1), (9, 0), (16, 513), (1, 77)]:
        streams.append(Stream(first, count, bits, at))
        first += count
        at += -(-count * bits // 8) + 300  # room for planar groups, and gaps between them
    values = torch.cat([torch.randint(0, 1 << s.bits, (s.count,), generator=g) for s in streams])
    st = Streams(streams, torch.device("cpu"))
    want = torch.full((at + 1,), 0xA5, dtype=torch.uint8)
    got = want.clone()
    kernels.pack_streams_torch(st, values, want, sink=at)
    kernels.pack_streams_c(st, values, got, sink=at)
    want[at] = got[at] = 0  # the sink: the caller's to overwrite
    assert torch.equal(got, want)
    assert torch.equal(kernels.unpack_streams_c(st, got, first), values)
    assert torch.equal(kernels.unpack_streams_torch(st, got, first), values)


@needs_c
def test_c_difference_takes_the_reference_for_a_bf16_model():
    params = [torch.randn(s).to(torch.bfloat16) for s in [(64, 3), (5,)]]
    ref = torch.randn(197)
    out_c, out_t = torch.empty(197), torch.empty(197)
    kernels.difference_c(views(out_c, params), views(ref, params), params, None)
    kernels.difference_torch(views(out_t, params), views(ref, params), params, None)
    assert torch.equal(out_c, out_t)


@needs_triton
@pytest.mark.parametrize("density", [1 / 64, 0.5])
def test_triton_selection_is_the_references_bits(density):
    codec = make_codec("topk", density=density)
    ts = [_with_ties(s, i) for i, s in enumerate(SHAPES)]
    ts[0][3, 5:9] = float("inf")
    flat = torch.cat([t.reshape(-1) for t in ts]).to(DEVICE)
    plan = codec.plan([t.shape for t in ts], torch.device(DEVICE))
    launched = kernels.launched
    got = _selected(plan, flat, kernels.select_triton)
    assert kernels.launched > launched and not kernels._broken  # the kernel ran
    ref = _selected(plan, flat, kernels.select_torch)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@needs_triton
@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp4"])
def test_triton_block_kernels_are_the_references_bits(name):
    codec, plan, flat = _block_bucket(name, DEVICE)
    n = plan.blocks
    s_t, c_t = torch.empty(n, device=DEVICE), torch.empty(n * 64, dtype=torch.uint8, device=DEVICE)
    s_r, c_r = torch.empty_like(s_t), torch.empty_like(c_t)
    kernels.quantize_triton(plan, flat, s_t, c_t)
    kernels.quantize_torch(plan, flat, s_r, c_r)
    assert torch.equal(s_t, s_r) and torch.equal(c_t, c_r)
    o_t, o_r = torch.empty(plan.numel, device=DEVICE), torch.empty(plan.numel, device=DEVICE)
    bad_t = kernels.dequantize_triton(plan, c_t, s_t, o_t)
    bad_r = kernels.dequantize_torch(plan, c_r, s_r, o_r)
    assert torch.equal(o_t, o_r) and bool(bad_t) == bool(bad_r) is False


def _runs_worker(rank: int, world: int) -> dict:
    out = {}
    for name, make in [
        ("streaming", lambda m, o, k: lowcomm.StreamingDiLoCo(
            m, o, sync_every=6, fragments=2, blocks_per_fragment=0, overlap=1, kernels=k)),
        ("sparseloco", lambda m, o, k: lowcomm.SparseLoCo(m, o, sync_every=5, kernels=k)),
        ("co2", lambda m, o, k: lowcomm.CO2(m, o, sync_every=5, kernels=k)),
    ]:  # fmt: skip
        for mode in ("auto", "torch"):
            model = tiny_model(seed=0)
            opt = adamw(model)
            with make(model, opt, mode):
                local_steps(model, opt, batches(rank, world), 17)
            out[(name, mode)] = flat_params(model)
    return out


def test_whole_runs_give_the_same_bits_with_every_kernel_and_the_references_alone(workers):
    for res in workers(_runs_worker, 2):
        for name in ("streaming", "sparseloco", "co2"):
            assert torch.equal(res[(name, "auto")], res[(name, "torch")]), name
