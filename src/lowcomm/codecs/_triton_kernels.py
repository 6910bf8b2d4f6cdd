"""The Triton kernels themselves (see :mod:`.kernels`, which imports this module only where
they may run: importing Triton costs about a second)."""

import triton
import triton.language as tl


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
    # the absmax as the largest pattern of |x|: ordered as the magnitudes, and a NaN's above
    # every number, so a block holding a NaN gets a NaN scale, as torch's maximum gives (which
    # NaN is the platform's; the clamp to the smallest scale keeps it)
    top = tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=1)
    s = top.to(tl.float32, bitcast=True)
    s = tl.where(top > 0x7F800000, s, tl.maximum(s, MIN_SCALE))
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
