"""Each kernel operation of lowcomm.codecs.kernels on the CPU: C against torch's reference, on
the `base` model's 59 tensors (10.08M parameters) at once, as a sync calls them, one thread.
Prints one JSON row per operation: milliseconds of each (median of 5 after a warm-up) and C's
speed-up; a plain copy of the model, timed the same way, for scale.

    python benchmarks/kernels_cpu.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from lowcomm.codecs import kernels, make_codec
from lowcomm.train.model import build_model


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def main() -> None:
    torch.set_num_threads(1)
    model = build_model("base")
    shapes = [p.shape for p in model.parameters()]
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(sum(p.numel() for p in model.parameters()), generator=g)
    rows = [{"op": "copy (the model)", "ms": round(timed(flat.clone), 2)}]

    def row(op: str, torch_fn, c_fn, what: str) -> None:
        t, c = timed(torch_fn), timed(c_fn)
        rows.append({"op": op, "on": what, "torch_ms": round(t, 2), "c_ms": round(c, 2),
                     "speedup": round(t / c, 2)})  # fmt: skip

    # top-k (SparseLoCo's default: 1/64 of each 64 x 64 tile, 2-bit values)
    topk = make_codec("topk")
    plan = topk.plan(shapes, torch.device("cpu"))
    local = torch.empty(plan.kept, dtype=torch.int64)
    values = torch.empty(plan.kept)
    row("select", lambda: [kernels.select_torch(flat, grp, local, values) for grp in plan.groups],
        lambda: [kernels.select_c(flat, grp, local, values) for grp in plan.groups],
        "top-k 1/64")  # fmt: skip
    out = torch.zeros(plan.span + 1, dtype=torch.uint8)
    plan.encode(flat, out)
    st = plan.indices
    idx = st.unpack(out, plan.kept)
    row(
        "pack_streams",
        lambda: kernels.pack_streams_torch(st, idx, out.clone(), plan.span),
        lambda: kernels.pack_streams_c(st, idx, out.clone(), plan.span),
        "top-k indices",
    )
    row("unpack_streams", lambda: kernels.unpack_streams_torch(st, out, plan.kept),
        lambda: kernels.unpack_streams_c(st, out, plan.kept), "top-k indices")  # fmt: skip

    for name in ("fp4", "int4", "int8"):  # Streaming's FP4, LoCo's int4, int8; blocks of 128
        _block_rows(name, shapes, flat, row)

    # the pseudo-gradient: reference - params, with the snapshot, over the model's tensors
    params = [p.detach() for p in model.parameters()]
    refs = [p.clone() + 1 for p in params]
    outs = [torch.empty_like(p) for p in params]
    snaps = [torch.empty_like(p) for p in params]
    row(
        "difference",
        lambda: kernels.difference_torch(outs, refs, params, snaps),
        lambda: kernels.difference_c(outs, refs, params, snaps),
        "the model, with snapshot",
    )
    for r in rows:
        print(json.dumps(r))


def _block_rows(name: str, shapes: list, flat: torch.Tensor, row) -> None:
    """The block codec ``name``'s operations over the model's tensors."""
    codec = make_codec(name, block_size=128)
    bp = codec.plan(shapes, torch.device("cpu"))
    scales = torch.empty(bp.blocks)
    codes = torch.empty(bp.blocks * codec.block_size, dtype=torch.uint8)
    into = torch.zeros(bp.numel)
    payload = torch.zeros(bp.span + 1, dtype=torch.uint8)
    bp.encode(flat, payload)
    row(
        "quantize",
        lambda: kernels.quantize_torch(bp, flat, scales, codes),
        lambda: kernels.quantize_c(bp, flat, scales, codes),
        name,
    )
    row(
        "dequantize (add)",
        lambda: kernels.dequantize_torch(bp, codes, scales, into, True),
        lambda: kernels.dequantize_c(bp, codes, scales, into, True),
        name,
    )
    row("scan", lambda: kernels.scan_torch(bp, payload), lambda: kernels.scan_c(bp, payload), name)
    if bp.per == 1:
        return
    row(
        "pack",
        lambda: kernels.pack_torch(bp, codes, payload.clone()),
        lambda: kernels.pack_c(bp, codes, payload.clone()),
        name,
    )
    row(
        "unpack",
        lambda: kernels.unpack_torch(bp, payload, codes.clone()),
        lambda: kernels.unpack_c(bp, payload, codes.clone()),
        name,
    )
    row(
        "decode_packed (add)",
        lambda: kernels.decode_packed_torch(bp, payload, scales, into, True),
        lambda: kernels.decode_packed_c(bp, payload, scales, into, True),
        name,
    )


if __name__ == "__main__":
    main()
