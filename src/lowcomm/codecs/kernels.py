"""The codecs' kernels: one interface per operation, and one function that says which
implementation of each runs (:func:`choose`).

The operations:

- ``select``: a group of top-k tiles' k largest magnitudes (the lower index among equal ones),
  tile-local indices in increasing order and the values (:class:`~.topk.Tiles` describes a
  group: each tile's first element, its tensor's row length, where its k values go);
- ``quantize`` / ``dequantize``: a block plan's tensors to one FP32 scale a block of ``B``
  values and one code a byte, and back (or added to what is there), with a 0-d bool saying
  whether a code outside the format was read (:class:`~.block.BlockCodec` holds the format,
  :class:`~.block.BlockPlan` where each tensor's blocks are);
- ``decode_packed``: ``dequantize`` straight from 2- or 4-bit codes packed in a payload;
- ``pack`` / ``unpack``: a block plan's codes, one a byte, to each tensor's planar bits in the
  payload (:func:`~.bitpack.pack_planar`'s layout), and back; ``scan``: whether a payload
  holds a code outside the format (a decoder's check; C reads the packed bytes);
  ``pack_streams`` / ``unpack_streams``: integers of any width in :class:`~.bitpack.Streams`
  (top-k's indices, the 2-bit table's codes);
- ``difference``: a fragment's pseudo-gradient ``reference - params`` into its slabs (with the
  continue merge's snapshot in the same pass) and a 0-d bool, whether every entry is finite.

Each has a torch implementation, the reference, present on every device. Triton's take over
on CUDA where Triton imports (:mod:`._triton_kernels`; under ``TRITON_INTERPRET=1`` they run on
a CPU, for the tests); C's on the CPU where they beat torch there (``_kernels.c``, built by
:mod:`._native`): top-k selection, a block's quantisation, dequantisation, packing and scan,
and the pseudo-gradient's difference with its finite check (benchmarks/kernels.md measures
each against its reference). Every implementation gives the
reference's bits; tests/test_kernels.py compares them.

The plans call the operations, never an implementation: what runs is :func:`choose`'s answer
for the device (and ``kernels=torch``, the setting that turns the others off), so a test that
patches it runs on a CPU the very choice a GPU makes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _native

log = logging.getLogger(__name__)

#: the settings of ``kernels=``: every implementation that runs here, or the torch ones only
MODES = ("auto", "torch")

#: Triton is an optional dependency (CUDA builds of torch bring it): whether it is installed
TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Kernels:
    """One implementation of each operation (see the module doc), and their names."""

    select: Callable[..., None]
    quantize: Callable[..., None]
    dequantize: Callable[..., torch.Tensor]
    decode_packed: Callable[..., torch.Tensor]
    pack: Callable[..., None]
    unpack: Callable[..., None]
    scan: Callable[..., torch.Tensor]
    pack_streams: Callable[..., None]
    unpack_streams: Callable[..., torch.Tensor]
    difference: Callable[..., torch.Tensor]
    names: dict[str, str] = field(default_factory=dict)


def check_mode(mode: str) -> str:
    """``mode`` if it is a setting of ``kernels=``; ValueError naming the choices if not."""
    if mode not in MODES:
        raise ValueError(f"kernels={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def choose(device: torch.device, mode: str = "auto") -> Kernels:
    """The implementations that run for tensors on ``device``: Triton's on CUDA where it
    imports (or under its interpreter on a CPU), C's on the CPU where the library builds,
    torch's elsewhere and under ``mode="torch"``. The one place the choice is made."""
    check_mode(mode)
    triton = mode == "auto" and _triton_usable(device)
    c = mode == "auto" and device.type == "cpu" and _native.lib() is not None
    picked = {
        "select": "triton" if triton else "c" if c else "torch",
        "quantize": "triton" if triton else "c" if c else "torch",
        "dequantize": "triton" if triton else "c" if c else "torch",
        "decode_packed": "c" if c else "torch",
        "pack": "c" if c else "torch",
        "unpack": "c" if c else "torch",
        "scan": "c" if c else "torch",
        "pack_streams": "c" if c else "torch",
        "unpack_streams": "c" if c else "torch",
        "difference": "c" if c else "torch",
    }
    return Kernels(**{op: _IMPLS[op][name] for op, name in picked.items()}, names=picked)


def _triton_usable(device: torch.device) -> bool:
    """Whether Triton runs for ``device``: installed, not failed here before, and a GPU (or the
    interpreter on, which runs the kernels on a CPU)."""
    if not TRITON or _broken:
        return False
    import os

    interpreted = os.environ.get("TRITON_INTERPRET", "") == "1"
    return device.type == "cuda" or (interpreted and device.type == "cpu")


# -- select ----------------------------------------------------------------------------------------
def select_torch(flat: torch.Tensor, tiles: Any, local: torch.Tensor, values: torch.Tensor) -> None:
    """Every tile of ``tiles``: the tile-local indices of its k largest magnitudes, increasing,
    into ``local`` and the values into ``values`` at the tile's place. Ranked by one exact key
    per entry (the magnitude's int32 pattern, then the lower index), so no choice among equal
    magnitudes is left to ``topk`` and nothing is read to the host."""
    for s in range(0, tiles.ntiles, tiles.band):
        x = tiles.tiles(flat, s)
        li = _ranked(x, tiles)
        dest = (tiles.kept_t[s : s + tiles.band, None] + tiles.lane).view(-1)
        local.index_copy_(0, dest, li.view(-1))
        values.index_copy_(0, dest, x.gather(1, li).view(-1))


def _ranked(x: torch.Tensor, tiles: Any) -> torch.Tensor:
    """Each row's k largest magnitudes' tile-local indices, increasing (ties: the lower)."""
    if tiles.k == 1:  # the first maximum: the lower index among equal ones
        return x.abs().argmax(dim=1, keepdim=True)
    if tiles.k == tiles.L:
        return tiles.lane.expand(x.shape[0], tiles.k)
    key = (x.abs().view(torch.int32).to(torch.int64) << tiles.index_bits) | tiles.rev
    top = key.topk(tiles.k, dim=1, sorted=False).values
    return ((tiles.L - 1) - (top & ((1 << tiles.index_bits) - 1))).sort(dim=1).values


def select_c(flat: torch.Tensor, tiles: Any, local: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`select_torch` by the C kernel (one tile at a time, its rows copied in order)."""
    lib = _native.lib()
    assert lib is not None
    flat = flat.contiguous()
    failed = lib.lc_select_tiles(
        flat.data_ptr(), tiles.base_t.data_ptr(), tiles.row_t.data_ptr(),
        tiles.kept_t.data_ptr(), tiles.ntiles, tiles.tr, tiles.tc, tiles.k,
        local.data_ptr(), values.data_ptr(),
    )  # fmt: skip
    if failed:  # out of memory in the kernel's scratch: the reference has its own
        select_torch(flat, tiles, local, values)


def select_triton(
    flat: torch.Tensor, tiles: Any, local: torch.Tensor, values: torch.Tensor
) -> None:
    """:func:`select_torch` by the Triton kernel: one program per tile, which reads the tile
    once and finds the k-th largest magnitude by a bitwise search."""
    if tiles.ntiles == 0:
        return
    from .bitpack import bits_for

    block = 1 << bits_for(tiles.L)
    warps = 4 if block >= 1024 else max(1, block // 256)
    if not _launch(
        "_select_tiles", flat.device, (tiles.ntiles,), flat, tiles.base_t, tiles.row_t,
        tiles.kept_t, local, values, TC=tiles.tc, L=tiles.L, K=tiles.k, BLOCK=block,
        num_warps=warps,
    ):  # fmt: skip
        select_torch(flat, tiles, local, values)


# -- quantize / dequantize -------------------------------------------------------------------
def quantize_torch(
    plan: Any, flat: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor
) -> None:
    """A block plan's scales (one a block) and codes (one a byte, block-laid) of ``flat`` (its
    tensors one after another) by the codec's torch steps (:meth:`~.block.BlockPlan.
    quantize_torch`)."""
    plan.quantize_torch(flat, scales, codes)


def dequantize_torch(
    plan: Any, codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, add: bool = False
) -> torch.Tensor:
    """The values of a block plan's ``codes`` into ``values`` (its tensors one after another),
    or with ``add`` added to it, by the codec's torch steps, and whether a code outside the
    format was read (a 0-d bool)."""
    return plan.dequantize_torch(codes, scales, values, add)


def quantize_c(plan: Any, flat: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> None:
    """:func:`quantize_torch` in one pass, tensor by tensor in one call, reading each from its
    place (round to nearest; an input that is not finite takes the reference, which
    propagates its NaN as torch does)."""
    codec = plan.codec
    fmt = codec.triton_format(flat.device)
    if fmt is None or codec.stochastic:
        quantize_torch(plan, flat, scales, codes)
        return
    lib = _native.lib()
    assert lib is not None
    qmax, offset, _ = fmt
    src, count, first = plan.value_runs
    if lib.lc_quantize_runs(
        flat.data_ptr(), count.numel(), src.data_ptr(), count.data_ptr(), first.data_ptr(),
        codec.block_size, qmax, offset, codec.min_scale, codec.pad_code, scales.data_ptr(),
        codes.data_ptr(),
    ):  # fmt: skip
        quantize_torch(plan, flat, scales, codes)


def dequantize_c(
    plan: Any, codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, add: bool = False
) -> torch.Tensor:
    """:func:`dequantize_torch` in one pass, each tensor written (or added) at its place."""
    codec = plan.codec
    fmt = codec.triton_format(values.device, decode=True)
    if fmt is None or not values.is_contiguous():
        return dequantize_torch(plan, codes, scales, values, add)
    lib = _native.lib()
    assert lib is not None
    qmax, offset, _ = fmt
    src, count, first = plan.value_runs
    bad = lib.lc_dequantize_runs(
        codes.data_ptr(), scales.data_ptr(), count.numel(), src.data_ptr(), count.data_ptr(),
        first.data_ptr(), codec.block_size, qmax, offset, int(add), values.data_ptr(),
    )  # fmt: skip
    return torch.tensor(bad > 0)


def decode_packed_torch(
    plan: Any, payload: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, add: bool
) -> torch.Tensor:
    """A block plan's values (written into ``values``, or added to it) straight from its
    packed ``payload`` (2 or 4 bits a code), and whether a code outside the format was read:
    the codes unpacked into a block-laid buffer, then dequantised (the plan's ``unpack`` and
    ``dequantize``: the reference, and what a GPU runs)."""
    return plan.kernels.dequantize(plan, plan.unpacked(payload), scales, values, add)


def decode_packed_c(
    plan: Any, payload: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, add: bool
) -> torch.Tensor:
    """:func:`decode_packed_torch` in one C pass, a group of codes unpacked at a time."""
    codec = plan.codec
    fmt = codec.triton_format(values.device, decode=True)
    if fmt is None or not values.is_contiguous():
        return decode_packed_torch(plan, payload, scales, values, add)
    lib = _native.lib()
    assert lib is not None
    qmax, offset, _ = fmt
    src, count, first = plan.value_runs
    dst = plan.runs[2]
    payload = payload.contiguous()
    bad = lib.lc_dequantize_planar(
        payload.data_ptr(), scales.data_ptr(), count.numel(), src.data_ptr(), count.data_ptr(),
        first.data_ptr(), dst.data_ptr(), codec.bits, codec.block_size, qmax, offset, int(add),
        values.data_ptr(),
    )  # fmt: skip
    return torch.tensor(bad > 0)


def _rows_grid(rows: int, B: int) -> tuple[int, int, int]:
    """(rows per program, B rounded up to a power of two, programs)."""
    from .bitpack import bits_for

    block = 1 << bits_for(max(1, B))
    per = max(1, 4096 // block)
    return per, block, -(-rows // per)


def quantize_triton(
    plan: Any, flat: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor
) -> None:
    """:func:`quantize_torch` in one pass over every block (round to nearest only: stochastic
    rounding's draws are torch's)."""
    codec = plan.codec
    fmt = codec.triton_format(flat.device)
    if fmt is None or codec.stochastic or plan.blocks == 0:
        quantize_torch(plan, flat, scales, codes)
        return
    xb = plan._blocks(flat)
    rows, B = xb.shape
    qmax, offset, table = fmt
    per, block, programs = _rows_grid(rows, B)
    lut = table if table is not None else codes
    if not _launch(
        "_quantize_rows", xb.device, (programs,), xb, scales, codes, lut, rows, B, QMAX=qmax,
        OFFSET=offset, MIN_SCALE=codec.min_scale, R=per, BLOCK=block, enable_fp_fusion=False,
    ):  # fmt: skip
        quantize_torch(plan, flat, scales, codes)


def dequantize_triton(
    plan: Any, codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, add: bool = False
) -> torch.Tensor:
    """:func:`dequantize_torch` in one pass over every block."""
    codec = plan.codec
    fmt = codec.triton_format(values.device, decode=True)
    if fmt is None or plan.blocks == 0:
        return dequantize_torch(plan, codes, scales, values, add)
    B = codec.block_size
    direct = plan.aligned and not add
    out = (
        values.view(plan.blocks, B) if direct else torch.empty(plan.blocks, B, device=values.device)
    )
    qmax, offset, table = fmt
    per, block, programs = _rows_grid(plan.blocks, B)
    bad = torch.empty(programs, dtype=torch.int32, device=values.device)
    lut = table if table is not None else scales
    if not _launch(
        "_dequantize_rows", values.device, (programs,), codes, scales, out, lut, bad, plan.blocks,
        B, QMAX=qmax, OFFSET=offset, R=per, BLOCK=block, enable_fp_fusion=False,
    ):  # fmt: skip
        return dequantize_torch(plan, codes, scales, values, add)
    if not direct:
        plan.unpad(out, values, add)
    return bad.amax() > 0


# -- pack / unpack ------------------------------------------------------------------------------
def pack_torch(plan: Any, codes: torch.Tensor, out: torch.Tensor) -> None:
    """Every tensor's codes of a block plan (block-laid in ``codes``) packed planar into ``out``
    at its place: the whole groups of every tensor at once (staged one after another and
    packed in one pass), each tensor's last partial group through a small index."""
    plan.pack_groups(codes, out)


def unpack_torch(plan: Any, payload: torch.Tensor, codes: torch.Tensor) -> None:
    """The inverse of :func:`pack_torch`: every tensor's codes from ``payload`` into ``codes``."""
    plan.unpack_groups(payload, codes)


def pack_c(plan: Any, codes: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`pack_torch` by the C kernel, tensor after tensor in one call."""
    lib = _native.lib()
    assert lib is not None
    src, count, dst = plan.runs
    lib.lc_pack_planar(
        codes.data_ptr(), count.numel(), src.data_ptr(), count.data_ptr(), dst.data_ptr(),
        plan.codec.bits, plan.codec.pad_code, out.data_ptr(),
    )  # fmt: skip


def unpack_c(plan: Any, payload: torch.Tensor, codes: torch.Tensor) -> None:
    """:func:`unpack_torch` by the C kernel."""
    lib = _native.lib()
    assert lib is not None
    src, count, dst = plan.runs
    payload = payload.contiguous()
    lib.lc_unpack_planar(
        payload.data_ptr(), count.numel(), src.data_ptr(), count.data_ptr(), dst.data_ptr(),
        plan.codec.bits, codes.data_ptr(),
    )  # fmt: skip


def scan_torch(plan: Any, payload: torch.Tensor) -> torch.Tensor:
    """Whether a block plan's ``payload`` holds a code outside the format (a 0-d bool):
    its codes unpacked, then the codec's check."""
    return plan.codes_bad(payload)


def scan_c(plan: Any, payload: torch.Tensor) -> torch.Tensor:
    """:func:`scan_torch` by the C kernel, on the packed bytes (nothing unpacked)."""
    lib = _native.lib()
    assert lib is not None
    _, count, dst = plan.runs
    payload = payload.contiguous()
    found = lib.lc_has_code(
        payload.data_ptr(), count.numel(), count.data_ptr(), dst.data_ptr(), plan.codec.bits,
        plan.codec.bad_code,
    )  # fmt: skip
    return torch.tensor(found > 0)


def pack_streams_torch(streams: Any, values: torch.Tensor, out: torch.Tensor, sink: int) -> None:
    """:class:`~.bitpack.Streams` of ``values`` (integers >= 0) into ``out`` by torch steps
    (bytes past a segment's end to ``out[sink]``, which the caller overwrites)."""
    streams.pack_torch(values, out, sink)


def unpack_streams_torch(streams: Any, payload: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` values (int64) of :class:`~.bitpack.Streams` in ``payload``."""
    return streams.unpack_torch(payload, count)  # type: ignore[no-any-return]


def pack_streams_c(streams: Any, values: torch.Tensor, out: torch.Tensor, sink: int) -> None:
    """:func:`pack_streams_torch` by the C kernel, byte by byte (nothing past a segment)."""
    lib = _native.lib()
    assert lib is not None
    values = values.to(torch.int64).contiguous()
    rows = streams.rows
    lib.lc_pack_streams(values.data_ptr(), rows.shape[0], rows.data_ptr(), out.data_ptr())


def unpack_streams_c(streams: Any, payload: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`unpack_streams_torch` by the C kernel."""
    lib = _native.lib()
    assert lib is not None
    payload = payload.contiguous()
    values = torch.zeros(max(streams.count, count), dtype=torch.int64)
    rows = streams.rows
    lib.lc_unpack_streams(payload.data_ptr(), rows.shape[0], rows.data_ptr(), values.data_ptr())
    return values[:count]


# -- difference -------------------------------------------------------------------------------
def difference_torch(
    out: list[torch.Tensor],
    refs: list[torch.Tensor],
    params: list[torch.Tensor],
    snaps: list[torch.Tensor] | None,
) -> torch.Tensor:
    """``ref - param`` into each ``out`` (FP32 views), then each param into its snapshot view
    if ``snaps``; a 0-d bool on the device, whether every difference is finite (nothing read).
    Multi-tensor kernels: launches that do not grow with the number of parameters."""
    plain = [p.detach() for p in params]
    torch._foreach_copy_(out, refs)
    torch._foreach_sub_(out, plain)
    if snaps is not None:
        torch._foreach_copy_(snaps, plain)
    return finite_flag(*out)


def difference_c(
    out: list[torch.Tensor],
    refs: list[torch.Tensor],
    params: list[torch.Tensor],
    snaps: list[torch.Tensor] | None,
) -> torch.Tensor:
    """:func:`difference_torch` in one pass per parameter (the check on the way), where every
    tensor is FP32 and contiguous on the CPU; else the reference."""
    plain = [p.detach() for p in params]
    tensors = [*out, *refs, *plain, *(snaps or [])]
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return difference_torch(out, refs, params, snaps)
    lib = _native.lib()
    assert lib is not None
    bad = 0
    for i, (o, r, p) in enumerate(zip(out, refs, plain)):
        s = snaps[i].data_ptr() if snaps is not None else None
        bad |= lib.lc_sub_check(r.data_ptr(), p.data_ptr(), o.data_ptr(), s, p.numel())
    return torch.tensor(not bad)


def finite_flag(*ts: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on the tensors' device: whether every element of every tensor is finite,
    exactly when their minima and maxima are (NaN propagates). Nothing is read to the host;
    one read pass, where ``isfinite(t).all()`` writes a mask the size of ``t`` first."""
    ends = [v for t in ts if t.numel() for v in torch.aminmax(t)]
    if not ends:
        return torch.ones((), dtype=torch.bool, device=ts[0].device if ts else None)
    return torch.isfinite(torch.stack(ends)).all()


_IMPLS: dict[str, dict[str, Callable[..., Any]]] = {
    "select": {"torch": select_torch, "c": select_c, "triton": select_triton},
    "quantize": {"torch": quantize_torch, "c": quantize_c, "triton": quantize_triton},
    "dequantize": {"torch": dequantize_torch, "c": dequantize_c, "triton": dequantize_triton},
    "decode_packed": {"torch": decode_packed_torch, "c": decode_packed_c},
    "pack": {"torch": pack_torch, "c": pack_c},
    "unpack": {"torch": unpack_torch, "c": unpack_c},
    "scan": {"torch": scan_torch, "c": scan_c},
    "pack_streams": {"torch": pack_streams_torch, "c": pack_streams_c},
    "unpack_streams": {"torch": unpack_streams_torch, "c": unpack_streams_c},
    "difference": {"torch": difference_torch, "c": difference_c},
}


# -- Triton's launches --------------------------------------------------------------------------
_broken = False
_loaded: Any = None  # the kernels' module, imported at first use (importing Triton takes ~1 s)
launched = 0  # Triton kernels launched in this process (a benchmark reports whether they ran)


def _launch(name: str, device: torch.device, grid: tuple[int, ...], *args: Any, **kw: Any) -> bool:
    """Launch Triton kernel ``name``; False where it failed, which turns Triton off for the
    process with a warning (a compile or launch failure must not stop a training run)."""
    global _loaded, _broken, launched
    try:
        if _loaded is None:
            from . import _triton_kernels

            _loaded = _triton_kernels
        on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on:
            getattr(_loaded, name)[grid](*args, **kw)
    except Exception as err:  # noqa: BLE001 (any failure: the reference takes over)
        _broken = True
        log.warning("lowcomm: Triton kernels turned off, the torch path takes over: %s", err)
        return False
    launched += 1
    return True
