"""The common 16-byte payload header and the checks every decoder runs on untrusted bytes.

Header (little-endian), at byte 0 of every payload::

    0..1   magic  b"LC"
    2      format version (1)
    3      codec id (CODEC_IDS)
    4..7   uint32 codec parameter (block size for int-k / fp4, k per chunk for top-k,
           value bits for the lookup codec, 0 for dense)
    8..15  uint64 number of elements

Sections after the header start at 4-byte aligned offsets so they can be viewed as fp32.
Multi-byte fields are little-endian (x86, ARM and CUDA devices all are).
"""

from __future__ import annotations

import struct
import sys

import torch

from ..errors import PayloadError
from .base import Plan, as_float_input, check_bytes, numel_of  # noqa: F401  (codecs: from here)
from .registry import specs

if sys.byteorder != "little":  # pragma: no cover - no big-endian torch platform in use
    raise ImportError("lowcomm codecs assume a little-endian host")

HEADER_BYTES = 16
MAGIC = b"LC"
VERSION = 1


# codec name -> header byte 3: each codec's ``@register(wire_id=...)`` (an alias writes its
# target's, under the target's name)
def codec_ids() -> dict[str, int]:
    """Every codec's wire id by name (a plugin's too, once its module is imported)."""
    return {s.name: s.wire_id for s in specs().values() if s.wire_id is not None}


CODEC_IDS = codec_ids()  # the core's own
_STRUCT = struct.Struct("<2sBBIQ")

#: elements per chunk of the CPU encode/decode loops: big enough to amortise the Python
#: overhead, small enough that the temporaries stay in cache (1 MiB of fp32).
CPU_CHUNK = 1 << 18
#: on accelerators a chunk only bounds the temporaries' memory
DEVICE_CHUNK = 1 << 24


def chunk_elems(device: torch.device) -> int:
    return CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK


def div_scalar(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c``, rounded alike on every device. CUDA divides by a Python (CPU) scalar as a
    multiplication by its reciprocal, which can miss the true quotient by the last bit; a
    divisor on the tensor's own device is divided by exactly, as on the CPU."""
    if t.device.type == "cpu":
        return t / c
    return t / torch.tensor(c, dtype=t.dtype, device=t.device)


def write_header(payload: torch.Tensor, codec: str, param: int, numel: int) -> None:
    raw = _STRUCT.pack(MAGIC, VERSION, codec_ids()[codec], param, numel)
    payload[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def set_headers(plan: Plan, params: list[int]) -> None:
    """Each of ``plan``'s tensors' header (its codec, ``params[i]``, its element count) at its
    place: ``plan.header_at`` the bytes, ``plan.header_want`` what they hold, on its device."""
    template = torch.zeros(max(plan.span, 1), dtype=torch.uint8)
    at = []
    for a, p, n in zip(plan.at, params, plan.sizes):
        write_header(template[a : a + HEADER_BYTES], plan.codec.name, p, n)
        at.append(torch.arange(a, a + HEADER_BYTES))
    plan.header_at = (torch.cat(at) if at else torch.empty(0, dtype=torch.int64)).to(plan.device)
    plan.header_want = template.to(plan.device)[plan.header_at]


def check_payload(
    payload: torch.Tensor,
    *,
    name: str,
    codec: str,
    describe: str,
    expected_nbytes: int,
    param: int,
    numel: int,
    shape,
) -> torch.Tensor:
    """Validate size and header; return the payload, copied if its start is misaligned."""
    check_bytes(payload, name)
    n = payload.numel()
    if n != expected_nbytes:
        raise PayloadError(
            f"{name}: payload has {n} bytes, expected {expected_nbytes} for shape "
            f"{tuple(shape)} with codec {describe}"
        )
    if not payload.is_contiguous() or payload.data_ptr() % 16:
        payload = payload.contiguous() if not payload.is_contiguous() else payload.clone()
        if payload.data_ptr() % 16:  # pragma: no cover - allocators align far more
            payload = payload.clone()
    magic, version, cid, got_param, got_numel = _STRUCT.unpack(
        bytes(payload[:HEADER_BYTES].tolist())
    )
    if magic != MAGIC:
        raise PayloadError(
            f"{name}: bad magic {magic!r} (expected {MAGIC!r}): not a lowcomm payload"
        )
    if version != VERSION:
        raise PayloadError(f"{name}: payload format version {version}, this build reads {VERSION}")
    ids = codec_ids()
    if cid != ids[codec]:
        was = next((n for n, i in ids.items() if i == cid), f"id {cid}")
        raise PayloadError(
            f"{name}: payload was encoded with codec {was}, decoding with {describe}"
        )
    if got_param != param:
        raise PayloadError(
            f"{name}: header parameter {got_param} does not match {describe} (expected {param})"
        )
    if got_numel != numel:
        raise PayloadError(
            f"{name}: header says {got_numel} elements, shape {tuple(shape)} has {numel}"
        )
    return payload


def check_finite_scales(scales: torch.Tensor, name: str, what: str = "scale") -> None:
    """Scales must be finite and non-negative (one host sync)."""
    if scales.numel() and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        bad = scales[~(torch.isfinite(scales) & (scales >= 0))][:3].tolist()
        raise PayloadError(f"{name}: invalid {what} (NaN, inf or negative): {bad}")


def check_finite(values: torch.Tensor, name: str, what: str) -> None:
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise PayloadError(f"{name}: non-finite {what}: {values[:8].tolist()}")
