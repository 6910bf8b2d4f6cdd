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
multiply-add), NaN propagated as torch's maximum does (a block holding a NaN gets a NaN scale;
which NaN, and so that block's codes, may differ from torch's, as they do between a CPU and a
GPU: every receiver refuses such a payload either way).

``LOWCOMM_TRITON=0`` turns the kernels off. A kernel that fails to compile or launch turns
itself off for the process, with a warning, and the torch path takes over.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from typing import Any

import torch

from .bitpack import bits_for

log = logging.getLogger(__name__)

#: Triton is an optional dependency (CUDA builds of torch bring it): whether it is installed
AVAILABLE = importlib.util.find_spec("triton") is not None
_broken = False
_loaded: Any = None  # the kernels' module, imported at first use
launched = 0  # kernels launched in this process (what a benchmark reports: whether they ran)


def usable(device: torch.device) -> bool:
    """Whether the kernels run for tensors on ``device``: Triton is installed, not turned off,
    has not failed here before, and the device is a GPU (or Triton's interpreter is on, which
    runs them on a CPU: the tests)."""
    if not AVAILABLE or _broken or os.environ.get("LOWCOMM_TRITON", "") == "0":
        return False
    interpreted = os.environ.get("TRITON_INTERPRET", "") == "1"
    return device.type == "cuda" or (interpreted and device.type == "cpu")


def _on(device: torch.device) -> Any:
    """A launch goes to the current CUDA device: make it the tensors' own."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def kernels() -> Any:
    """The kernels' module (imported once; an import error turns the kernels off as a failed
    launch does)."""
    global _loaded
    if _loaded is None:
        from . import _triton_kernels

        _loaded = _triton_kernels
    return _loaded


def _count() -> None:
    global launched
    launched += 1


def disable(err: BaseException) -> None:
    """Turn the kernels off for this process after ``err`` (the torch path takes over)."""
    global _broken
    _broken = True
    log.warning("lowcomm: Triton kernels turned off, the torch path takes over: %s", err)


def _rows_grid(rows: int, B: int) -> tuple[int, int, int]:
    """(rows per program, B rounded up to a power of two, programs)."""
    block = 1 << bits_for(max(1, B))
    per = max(1, 4096 // block)
    return per, block, -(-rows // per)


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
        with _on(xb.device):
            kernels()._quantize_rows[(programs,)](
                xb, scales, codes, lut, rows, B, QMAX=qmax, OFFSET=offset, MIN_SCALE=min_scale,
                R=per, BLOCK=block, enable_fp_fusion=False,
            )  # fmt: skip
    except Exception as err:  # a compile or launch failure must not stop a training run
        disable(err)
        return False
    _count()
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
        with _on(out.device):
            kernels()._dequantize_rows[(programs,)](
                codes, scales, out, lut, bad, rows, B, QMAX=qmax, OFFSET=offset, R=per,
                BLOCK=block, enable_fp_fusion=False,
            )  # fmt: skip
    except Exception as err:
        disable(err)
        return None
    _count()
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
        block = 1 << bits_for(L)
        warps = 4 if block >= 1024 else max(1, block // 256)
        with _on(flat.device):
            kernels()._select_tiles[(base.numel(),)](
                flat,
                base,
                row,
                kept_at,
                local,
                values,
                TC=tc,
                L=L,
                K=k,
                BLOCK=block,
                num_warps=warps,
            )
    except Exception as err:  # a compile or launch failure must not stop a training run
        disable(err)
        return False
    _count()
    return True
