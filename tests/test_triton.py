"""The fused Triton kernels (codecs/_triton.py) against the torch path they replace: the same
indices and values, bit for bit, ties, zeros and non-finite entries included.

They run where Triton does: compiled on a GPU (``make gpu-check``), or on a CPU under Triton's
interpreter (``TRITON_INTERPRET=1`` set before the import, with Triton installed:
docs/testing.md); skipped elsewhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_topk_many import SHAPES, bucket

from lowcomm.codecs import PayloadError, _triton, make_codec
from lowcomm.codecs.topk_many import TopKPlan

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.skipif(not _triton.AVAILABLE, reason="Triton is not installed"),
    pytest.mark.skipif(
        DEVICE == "cpu" and not INTERPRETED, reason="no GPU, and Triton's interpreter is off"
    ),
]
if DEVICE == "cuda":
    pytestmark.append(pytest.mark.cuda)


def _select(plan: TopKPlan, flat: torch.Tensor, fused: bool, monkeypatch) -> tuple:
    monkeypatch.setenv("LOWCOMM_TRITON", "1" if fused else "0")
    return plan.select(flat)


@pytest.mark.parametrize("density", [1 / 64, 1 / 8, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_selection_is_the_torch_paths(density, seed, monkeypatch):
    codec = make_codec("topk", density=density)
    tensors = bucket(seed)
    tensors[6][1, 2, :] = float("inf")  # a tile of infinities: more equal maxima than kept
    tensors[7][100] = float("nan")
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(DEVICE)
    plan = TopKPlan(codec, [t.shape for t in tensors], torch.device(DEVICE))
    assert _triton.usable(flat.device)
    li_t, v_t = _select(plan, flat, False, monkeypatch)
    launched = _triton.launched
    li_f, v_f = _select(plan, flat, True, monkeypatch)
    assert not _triton._broken and _triton.launched > launched  # the kernel ran
    assert torch.equal(li_f, li_t)
    assert torch.equal(v_f.view(torch.int32), v_t.view(torch.int32))  # NaN's bits too


def test_fused_payload_is_the_torch_paths(monkeypatch):
    """A whole encode (selection, table, packing) writes the same bytes either way."""
    codec = make_codec("topk")
    shapes = [torch.Size(s) for s in SHAPES]
    tensors = bucket(3)
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(DEVICE)
    plan = TopKPlan(codec, shapes, torch.device(DEVICE))
    out = []
    for fused in (False, True):
        monkeypatch.setenv("LOWCOMM_TRITON", "1" if fused else "0")
        payload = torch.empty(plan.nbytes + 1, dtype=torch.uint8, device=DEVICE)
        idx, vals = plan.encode(flat, payload)
        out.append((payload[:-1].clone(), idx, vals))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])
    assert torch.equal(out[0][2], out[1][2])


def test_a_failing_kernel_hands_over_to_torch(monkeypatch):
    """A kernel that cannot run turns itself off once, and the torch path gives the result."""
    codec = make_codec("topk")
    tensors = bucket(0)
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(DEVICE)
    plan = TopKPlan(codec, [t.shape for t in tensors], torch.device(DEVICE))
    want = _select(plan, flat, False, monkeypatch)
    monkeypatch.setattr(_triton, "_broken", False)
    monkeypatch.setattr(_triton, "kernels", lambda: _Unlaunchable())
    got = _select(plan, flat, True, monkeypatch)
    assert _triton._broken
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class _Unlaunchable:
    """Stands in for the kernels' module: every kernel's launch raises."""

    class _Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel today")

            return launch

    _select_tiles = _quantize_rows = _dequantize_rows = _Kernel()


def _block_inputs(seed: int) -> list[torch.Tensor]:
    """Tensors whose blocks hold the block codecs' hard cases: a short last block, zeros, values
    below the smallest scale, infinities, a NaN, and magnitudes from 1e-30 to 1e30."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(3000, generator=g) * 10.0 ** torch.randint(-30, 30, (3000,), generator=g)
    big[:256] = 0.0
    big[256:300] = 1e-35
    big[700] = float("inf")
    big[1100] = -float("inf")
    big[1500] = float("nan")
    return [big, torch.randn(5, 77, generator=g), torch.randn(1, generator=g)]


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp4"])
@pytest.mark.parametrize("block", [256, 128, 96, 1000])
def test_fused_block_codecs_write_and_read_the_torch_paths_bits(name, block, monkeypatch):
    from lowcomm.codecs import _native

    monkeypatch.setattr(_native, "usable", lambda *tensors: None)  # FP4's C kernels step aside
    codec = make_codec(name, block_size=block)
    for t in _block_inputs(block):
        t = t.to(DEVICE)
        # a block holding a NaN gets a NaN scale and is refused by every receiver; which NaN
        # (its bits, and so its codes') is the platform's, so the bytes are compared without it
        numbers = t.nan_to_num(0.0, float("inf"), -float("inf"))
        finite = t.nan_to_num(0.0, 0.0, 0.0)
        for x in (numbers, finite):
            monkeypatch.setenv("LOWCOMM_TRITON", "0")
            want = codec.encode(x)
            monkeypatch.setenv("LOWCOMM_TRITON", "1")
            got = codec.encode(x)
            assert torch.equal(got, want), (name, block, x.shape)
        for fused in ("0", "1"):
            monkeypatch.setenv("LOWCOMM_TRITON", fused)
            if bool(torch.isnan(t).any()):
                with pytest.raises(PayloadError, match="invalid scale"):
                    codec.decode(codec.encode(t), t.shape)
        back = []
        for fused in ("0", "1"):
            monkeypatch.setenv("LOWCOMM_TRITON", fused)
            back.append(codec.decode(want, t.shape).view(torch.int32))
        assert torch.equal(back[0], back[1])
    assert not _triton._broken


@pytest.mark.parametrize("name", ["int4", "fp4"])
def test_fused_block_decode_refuses_what_the_torch_path_refuses(name, monkeypatch):
    codec = make_codec(name)
    t = torch.randn(1024).to(DEVICE)
    payload = codec.encode(t).clone()
    payload[16 + 4 * 4 + 7] = 0 if name != "fp4" else 0x88  # a code outside the format
    for fused in ("0", "1"):
        monkeypatch.setenv("LOWCOMM_TRITON", fused)
        with pytest.raises(PayloadError, match="codes outside"):
            codec.decode(payload, t.shape)
