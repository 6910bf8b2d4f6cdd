"""The codecs' fused CPU kernels (``_kernels.c``), compiled once per machine and loaded with
ctypes; ``None`` where that is not possible, and the codecs then use their torch path, which
gives the same bits (tests/test_native.py compares the two).

The library is built with the system C compiler (``cc``, or ``$CC``) into a cache folder
(``$LOWCOMM_CACHE`` or ``~/.cache/lowcomm``), named by a hash of the source and the flags, on
first use or by :func:`build` (``make install`` calls it). No torch
headers, no build step in the package install. ``LOWCOMM_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_kernels.c")
# -ffp-contract=off: no fused multiply-adds, so float results round exactly as torch's do
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "lc_topk_select": (_I64, [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR]),
    "lc_fp4_encode": (_I64, [_PTR, _I64, _I64, _I64, ctypes.c_float, ctypes.c_uint8, _PTR, _PTR]),
    "lc_selected_mean": (_I64, [_I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR]),
    "lc_topk_indices": (_I64, [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR]),
    "lc_lut_decode": (_I64, [_PTR, _I64, _I64, _PTR, ctypes.c_float, _PTR]),
    "lc_sub_check": (_I64, [_PTR, _PTR, _PTR, _PTR, _I64]),
    "lc_fp4_decode_mean": (_I64, [_I64, _PTR, _PTR, _PTR, ctypes.c_float, _I64, _I64, _PTR]),
}
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("LOWCOMM_CACHE") or Path.home() / ".cache" / "lowcomm"
    return Path(root)


def build() -> Path:
    """Compile the kernels (if not cached) and return the library's path; raises on failure."""
    cc = os.environ.get("CC", "cc")
    text = SOURCE.read_bytes()
    tag = hashlib.sha256(text + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"lowcomm_kernels_{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: workers starting at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (off, no compiler, or the build failed: logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("LOWCOMM_NATIVE", "1") == "0":
        return None
    try:
        loaded = ctypes.CDLL(str(build()))
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.restype, fn.argtypes = res, args
        _lib = loaded
    except (OSError, subprocess.SubprocessError) as e:
        log.info("codec kernels not built (%s): the torch path is used", e)
    return _lib


def usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels if every tensor is a contiguous CPU tensor, else None."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return lib()
    return None


def ptr(t: torch.Tensor) -> int:
    """The address of a tensor's first element."""
    return t.data_ptr()


def addresses(tensors: list[torch.Tensor]) -> ctypes.Array:
    """The tensors' addresses as a C array of int64."""
    return (ctypes.c_int64 * len(tensors))(*[t.data_ptr() for t in tensors])
