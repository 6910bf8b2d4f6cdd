"""Fused device kernels in Triton, where Triton is installed (CUDA builds of torch ship it; the
CPU build does not, and nothing here is needed there): a top-k tile's selection in one read of
its elements.

The torch path selects a tile's k largest magnitudes with a gather of the tile, ``abs``,
``topk``, a tie check, a sort of the kept indices and two scatters: seven passes and their
temporaries, about 0.01x a device copy. The kernel here reads each tile once and writes only
what it keeps: one program per tile finds the k-th largest magnitude by a bitwise search over
the magnitudes' int32 patterns (31 counts over values held in registers), then keeps every
larger entry and, among those equal to it, the lowest indices, written in increasing index
order: the rule of :func:`~.topk_many._ranked`'s exact key, ties included, so its indices and
values are the torch path's, bit for bit (tests/test_triton.py compares them under Triton's
interpreter on a CPU and compiled on a GPU).

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
