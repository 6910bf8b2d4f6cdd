"""Building and loading the CPU's kernels (``_kernels.c``): compiled once per machine and
loaded with ctypes; ``None`` where that is not possible, and :mod:`.kernels` then chooses the
torch implementations, which give the same bits.

The library is built with the system C compiler (``cc``, or ``$CC``) into a cache folder
(``$LOWCOMM_CACHE`` or ``~/.cache/lowcomm``), named by a hash of the source and the flags, on
first use or by :func:`build` (``make install`` calls it). No torch headers, no build step in
the package install. ``kernels=torch`` runs without them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_kernels.c")
# -ffp-contract=off: no fused multiply-adds, so float results round exactly as torch's do
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno"]
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "lc_select_tiles": (_I64, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]),
    "lc_sub_check": (_I64, [_PTR, _PTR, _PTR, _PTR, _I64]),
    "lc_quantize_rows": (_I64, [_PTR, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR, _PTR]),
    "lc_dequantize_rows": (_I64, [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR]),
    "lc_quantize_runs": (
        _I64,
        [
            _PTR,
            _I64,
            _PTR,
            _PTR,
            _PTR,
            _I64,
            _I64,
            _I64,
            ctypes.c_float,
            ctypes.c_uint8,
            _PTR,
            _PTR,
        ],
    ),
    "lc_dequantize_runs": (
        _I64,
        [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR],
    ),
    "lc_pack_planar": (_I64, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, ctypes.c_uint8, _PTR]),
    "lc_unpack_planar": (_I64, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR]),
    "lc_dequantize_planar": (
        _I64,
        [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR],
    ),
    "lc_pack_streams": (_I64, [_PTR, _I64, _PTR, _PTR]),
    "lc_unpack_streams": (_I64, [_PTR, _I64, _PTR, _PTR]),
    "lc_has_code": (_I64, [_PTR, _I64, _PTR, _PTR, _I64, ctypes.c_uint8]),
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
    try:
        loaded = ctypes.CDLL(str(build()))
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.restype, fn.argtypes = res, args
        _lib = loaded
    except (OSError, subprocess.SubprocessError) as e:
        log.info("codec kernels not built (%s): the torch path is used", e)
    return _lib
