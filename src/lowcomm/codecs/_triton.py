"""Fused device kernels in Triton, where Triton is installed (CUDA builds of torch ship it; the
CPU build does not, and nothing here is needed there): a top-k tile's selection in one read of
its elements, and a block codec's quantisation and dequantisation in one pass.

The torch path selects a tile's k largest magnitudes with a gather of the tile, ``abs``,
``topk``, a tie check, a sort of the kept indices and two scatters: seven passes and their
temporaries, about 0.01x a device copy. The kernel here reads each tile once and writes only
what it keeps: one program per tile finds the k-th largest magnitude by a bitwise search over
the magnitudes' int32 patterns (31 counts over values held in registers), then keeps every
larger entry and, among those equal to it, the lowest indices, written in increasing index
order: the rule of :func:`~.topk_many._ranked`'s exact key, ties included, so its indices and
values are the torch path's, bit for bit (tests/test_triton.py compares them under Triton's
interpreter on a CPU and compiled on a GPU).

The block codecs' chunk step (int8, int4, int2, FP4: absmax, scale, code; and back) takes four
to five passes over FP32 in torch; :func:`quantize` and :func:`dequantize` read each block once
and write its codes (one a byte; the codec packs them) and its scale, with torch's roundings:
the reciprocal of the scale divided exactly, products and sums rounded apart (no fused
multiply-add), NaN propagated as torch's maximum does.

``LOWCOMM_TRITON=0`` turns the kernels off. A kernel that fails to compile or launch turns
itself off for the process, with a warning, and the torch path takes over.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

try:  # an optional dependency: CUDA builds of torch bring it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build has no Triton
    triton = None  # type: ignore[assignment]

_broken = False


def usable(device: torch.device) -> bool:
    """Whether the kernels run for tensors on ``device``: Triton is importable, not turned off,
    has not failed here before, and the device is a GPU (or Triton's interpreter is on, which
    runs them on a CPU: the tests)."""
    if triton is None or _broken or os.environ.get("LOWCOMM_TRITON", "") == "0":
        return False
    interpreted = os.environ.get("TRITON_INTERPRET", "") == "1"
    return device.type == "cuda" or (interpreted and device.type == "cpu")


def disable(err: BaseException) -> None:
    """Turn the kernels off for this process after ``err`` (the torch path takes over)."""
    global _broken
    _broken = True
    log.warning("lowcomm: Triton kernels turned off, the torch path takes over: %s", err)


if triton is not None:

    @triton.jit
    def _select_tiles(
        flat,  # FP32 input, the bucket's tensors one after another
        base,  # int64 per tile: its first element in flat
        row,  # int64 per tile: its tensor's row length
        kept_at,  # int64 per tile: where its k kept entries go
        out_index,  # int64 out: tile-local indices, increasing within a tile
        out_value,  # FP32 out: the kept values
        TC: tl.constexpr,  # tile columns
        L: tl.constexpr,  # tile elements (TR * TC)
        K: tl.constexpr,  # entries kept per tile
        BLOCK: tl.constexpr,  # L rounded up to a power of two
    ):
        t = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        inside = i < L
        start = tl.load(base + t)
        stride = tl.load(row + t)
        x = tl.load(flat + start + (i // TC) * stride + (i % TC), mask=inside, other=0.0)
        # |x| as its int32 bit pattern: ordered like the magnitudes (NaN above inf, as topk's)
        key = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        key = tl.where(inside, key, -1)
        # the k-th largest key: the largest t with at least K keys >= t, bit by bit
        kth = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
        for b in tl.static_range(30, -1, -1):
            cand = kth | (1 << b)
            n = tl.sum((key >= cand).to(tl.int32), axis=0)
            kth = tl.where(n >= K, cand, kth)
        above = key > kth
        need = K - tl.sum(above.to(tl.int32), axis=0)
        tied = key == kth
        keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
        at = tl.load(kept_at + t) + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_index + at, i.to(tl.int64), mask=keep)
        tl.store(out_value + at, x, mask=keep)


if triton is not None:

    @triton.jit
    def _quantize_rows(
        x,  # FP32 (rows, B), contiguous
        scales,  # FP32 out (rows,)
        codes,  # uint8 out (rows * B,)
        table,  # uint8 (1024,): FP4's code of each 10-bit key (unused for int-k)
        rows,
        B,
        QMAX: tl.constexpr,  # int-k: 2**(bits-1) - 1; 0: FP4
        OFFSET: tl.constexpr,
        MIN_SCALE: tl.constexpr,
        R: tl.constexpr,  # rows per program
        BLOCK: tl.constexpr,  # B rounded up to a power of two
    ):
        r = tl.program_id(0) * R + tl.arange(0, R)
        c = tl.arange(0, BLOCK)
        inside = (r[:, None] < rows) & (c[None, :] < B)
        at = r[:, None].to(tl.int64) * B + c[None, :]
        v = tl.load(x + at, mask=inside, other=0.0)
        nan = tl.max((v != v).to(tl.int32), axis=1) > 0
        s = tl.maximum(tl.max(tl.abs(v), axis=1), MIN_SCALE)
        s = tl.where(nan, float("nan"), s)  # torch's amax propagates a NaN; clamp keeps it
        tl.store(scales + r, s, mask=r < rows)
        inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)  # torch's reciprocal
        if QMAX > 0:  # int-k: round(x qmax / s) + offset in the low bits of a float's pattern
            y = v * (inv * QMAX)[:, None]
            y = y + (8388608.0 + OFFSET)
            code = (y.to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8)
        else:  # FP4: the code of the top 10 bits of x / s
            y = v * inv[:, None]
            key = (y.to(tl.int32, bitcast=True) >> 22) & 0x3FF
            code = tl.load(table + key, mask=inside, other=0)
        tl.store(codes + at, code, mask=inside)

    @triton.jit
    def _dequantize_rows(
        codes,  # uint8 (rows * B,)
        scales,  # FP32 (rows,)
        out,  # FP32 out (rows, B)
        table,  # FP32 (16,): FP4's value of each code (unused for int-k)
        bad,  # int32 out (programs,): whether a code outside the format was read
        rows,
        B,
        QMAX: tl.constexpr,
        OFFSET: tl.constexpr,
        R: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        r = pid * R + tl.arange(0, R)
        c = tl.arange(0, BLOCK)
        inside = (r[:, None] < rows) & (c[None, :] < B)
        at = r[:, None].to(tl.int64) * B + c[None, :]
        q = tl.load(codes + at, mask=inside, other=0).to(tl.int32)
        s = tl.load(scales + r, mask=r < rows, other=1.0)
        if QMAX > 0:  # (code - offset) * (s / qmax), the division exact as torch's
            step = tl.math.div_rn(s, tl.full(s.shape, QMAX, tl.float32))
            v = (q.to(tl.float32) - OFFSET) * step[:, None]
            wrong = q == 0
        else:
            v = tl.load(table + q, mask=inside, other=0.0) * s[:, None]
            wrong = q == 8
        tl.store(out + at, v, mask=inside)
        tl.store(bad + pid, tl.max(tl.max((wrong & inside).to(tl.int32), axis=1), axis=0))


def _rows_grid(rows: int, B: int) -> tuple[int, int, int]:
    """(rows per program, B rounded up to a power of two, programs)."""
    block = triton.next_power_of_2(max(1, B))
    per = max(1, 4096 // block)
    return per, block, triton.cdiv(rows, per)


def quantize(
    xb: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    qmax: int,
    offset: int,
    min_scale: float,
    table: torch.Tensor | None = None,
) -> bool:
    """A block codec's codes (one a byte, into ``codes``) and scales of the rows of ``xb``
    (``qmax`` 0: FP4 by ``table``); False (nothing written) where the kernel does not run."""
    rows, B = xb.shape
    if not usable(xb.device) or rows == 0 or not xb.is_contiguous():
        return False
    try:
        per, block, programs = _rows_grid(rows, B)
        lut = table if table is not None else codes
        _quantize_rows[(programs,)](
            xb, scales, codes, lut, rows, B, QMAX=qmax, OFFSET=offset, MIN_SCALE=min_scale,
            R=per, BLOCK=block, enable_fp_fusion=False,
        )  # fmt: skip
    except Exception as err:  # a compile or launch failure must not stop a training run
        disable(err)
        return False
    return True


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    qmax: int,
    offset: int,
    table: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The values of a block codec's codes into ``out`` (rows, B) and a 0-d bool: whether a
    code outside the format was read; None (nothing written) where the kernel does not run."""
    rows, B = out.shape
    if not usable(out.device) or rows == 0 or not out.is_contiguous():
        return None
    try:
        per, block, programs = _rows_grid(rows, B)
        bad = torch.empty(programs, dtype=torch.int32, device=out.device)
        lut = table if table is not None else scales
        _dequantize_rows[(programs,)](
            codes, scales, out, lut, bad, rows, B, QMAX=qmax, OFFSET=offset, R=per,
            BLOCK=block, enable_fp_fusion=False,
        )  # fmt: skip
    except Exception as err:
        disable(err)
        return None
    return bad.amax() > 0


def select_tiles(
    flat: torch.Tensor,
    base: torch.Tensor,
    row: torch.Tensor,
    kept_at: torch.Tensor,
    tc: int,
    L: int,
    k: int,
    local: torch.Tensor,
    values: torch.Tensor,
) -> bool:
    """Select the k largest magnitudes (the lower index among equal ones) of every tile of one
    geometry into ``local`` (tile-local indices) and ``values`` at each tile's ``kept_at``;
    False (nothing written) where the kernel is unavailable or failed."""
    if not usable(flat.device) or base.numel() == 0:
        return False
    try:
        block = triton.next_power_of_2(L)
        warps = 4 if block >= 1024 else max(1, block // 256)
        _select_tiles[(base.numel(),)](
            flat, base, row, kept_at, local, values, TC=tc, L=L, K=k, BLOCK=block, num_warps=warps
        )
    except Exception as err:  # a compile or launch failure must not stop a training run
        disable(err)
        return False
    return True
