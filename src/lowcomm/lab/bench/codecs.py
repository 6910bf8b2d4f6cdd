"""`lowcomm bench codecs`: codec speed and size, measured against a plain copy in the same run.

For every codec, on one large FP32 tensor (``--numel``, default 16M elements, shaped
``numel/4096 x 4096`` when it divides, so top-k sees 64x64 tiles) and on a realistic mix (the
parameter shapes of a small Llama-style transformer, about 16.8M elements in 30 tensors):

- encode and decode throughput in GB/s of FP32 input (best of ``--repeats``), each also as the
  median over ``--repeats`` interleaved pairs of its ratio to ``dst.copy_(src)`` of the same
  tensors timed right before it (machines here are shared and noisy: only the side-by-side
  ratios mean much);
- bits per parameter on the wire, from the real payload sizes, and the format's formula;
- relative L2 error ``||x - D(C(x))|| / ||x||`` on Gaussian data.

Allocation matters on a CPU: every encode returns a fresh payload and every decode a fresh
FP32 tensor, and glibc serves allocations above 32 MiB with a new mmap whose pages fault in
4 KiB at a time (on the dev VM that costs several copies' worth of time for 64 MiB). PyTorch's
``THP_MEM_ALLOC_ENABLE=1`` (read once, before torch allocates anything) backs large tensors
with 2 MiB pages and removes most of that cost; the header line says which was in effect.

Targets (docs/benchmarking.md §3): encode >= 0.25x copy for dense and uniform codecs, >= 0.1x for
top-k; wire bits within 1% of the formula.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from lowcomm.codecs import Codec, kernels, make_codec

#: (label, codec name, options)
CODECS: list[tuple[str, str, dict]] = [
    ("fp32", "fp32", {}),
    ("bf16", "bf16", {}),
    ("fp16", "fp16", {}),
    ("int8", "int8", {}),
    ("int4", "int4", {}),
    ("int2", "int2", {}),
    ("fp4", "fp4", {}),
    ("int4-stochastic", "int4", {"stochastic": True}),
    ("topk", "topk", {}),
    ("topk-1/32", "topk", {"density": 1 / 32}),
]


def transformer_shapes(
    vocab: int = 4096, dim: int = 512, layers: int = 4, hidden: int = 1376
) -> list[tuple[int, ...]]:
    """Parameter shapes of a small Llama-style decoder (untied embedding and head)."""
    shapes: list[tuple[int, ...]] = [(vocab, dim)]
    for _ in range(layers):
        shapes += [
            (dim,),
            (dim, dim),
            (dim, dim),
            (dim, dim),
            (dim, dim),
            (dim,),
            (hidden, dim),
            (hidden, dim),
            (dim, hidden),
        ]
    shapes += [(dim,), (vocab, dim)]
    return shapes


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of ``fn()``, its device work included (a GPU runs kernels after they return)."""
    _settle()
    t0 = time.perf_counter()
    fn()
    _settle()
    return time.perf_counter() - t0


def _settle() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _against_copy(
    copy: Callable[[], object], fn: Callable[[], object], repeats: int
) -> tuple[float, float, float]:
    """(median of copy/fn time ratios over ``repeats`` interleaved pairs, best copy s, best fn s).

    Interleaving pairs each reading with a copy taken moments before it, so the load of a shared
    machine drifts out of the ratio; the median discards the odd disturbed pair.
    """
    copy()  # warm-up (allocator, lazily built tables)
    fn()
    ratios, best_copy, best_fn = [], math.inf, math.inf
    for _ in range(repeats):
        c, f = _timed(copy), _timed(fn)
        ratios.append(c / f)
        best_copy, best_fn = min(best_copy, c), min(best_fn, f)
    return statistics.median(ratios), best_copy, best_fn


def measure(label: str, codec: Codec, tensors: list[torch.Tensor], repeats: int) -> dict:
    numel = sum(t.numel() for t in tensors)
    dsts = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for d, t in zip(dsts, tensors):
            d.copy_(t)

    payloads: list[torch.Tensor] = []

    def encode() -> None:
        payloads[:] = [codec.encode(t) for t in tensors]

    def decode() -> None:
        for p, t in zip(payloads, tensors):
            codec.decode(p, t.shape)

    enc_ratio, t_copy, t_enc = _against_copy(copy, encode, repeats)
    dec_ratio, t_copy2, t_dec = _against_copy(copy, decode, repeats)
    t_copy = min(t_copy, t_copy2)
    err2 = ref2 = 0.0
    wire = formula = 0.0
    for p, t in zip(payloads, tensors):
        err2 += float((codec.decode(p, t.shape) - t).pow(2).sum())
        ref2 += float(t.pow(2).sum())
        wire += 8.0 * p.numel()
        formula += codec.formula_bits_per_param(t.shape) * t.numel()
    gb = 4.0 * numel / 1e9
    return {
        "codec": label,
        "numel": numel,
        "tensors": len(tensors),
        "encode_gbps": gb / t_enc,
        "decode_gbps": gb / t_dec,
        "copy_gbps": gb / t_copy,
        "encode_vs_copy": enc_ratio,
        "decode_vs_copy": dec_ratio,
        "wire_bits_per_param": wire / numel,
        "formula_bits_per_param": formula / numel,
        "rel_l2_error": math.sqrt(err2 / ref2) if ref2 else 0.0,
    }


def _table(rows: list[dict]) -> str:
    head = (
        "| codec | numel | tensors | encode GB/s | decode GB/s | copy GB/s | encode/copy | "
        "decode/copy | wire bits/param | formula bits/param | rel L2 error |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['numel']} | {r['tensors']} | {r['encode_gbps']:.2f} | "
            f"{r['decode_gbps']:.2f} | {r['copy_gbps']:.2f} | {r['encode_vs_copy']:.3f} | "
            f"{r['decode_vs_copy']:.3f} | {r['wire_bits_per_param']:.4f} | "
            f"{r['formula_bits_per_param']:.4f} | {r['rel_l2_error']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lowcomm bench codecs", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print a JSON list of result rows")
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements of the large tensor")
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved (copy, codec) timing pairs; ratios are their median",
    )
    ap.add_argument(
        "--codecs",
        default=None,
        help="comma-separated labels to run (default: all of "
        + ", ".join(c[0] for c in CODECS)
        + ")",
    )
    ap.add_argument("--no-mix", action="store_true", help="skip the transformer-shapes mix")
    ap.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1, as each worker of a multi-process run "
        "uses; 0 keeps torch's default)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.numel < 1 or args.repeats < 1:
        ap.error("--numel and --repeats must be positive")
    chosen = CODECS
    if args.codecs:
        want = [c.strip() for c in args.codecs.split(",") if c.strip()]
        labels = [c[0] for c in CODECS]
        bad = [w for w in want if w not in labels]
        if bad:
            ap.error(f"unknown codec label(s) {bad}; choose from {labels}")
        chosen = [c for c in CODECS if c[0] in want]

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    n = args.numel
    big_shape = (n // 4096, 4096) if n % 4096 == 0 else (n,)
    big = [torch.randn(big_shape, generator=gen).to(dev)]
    cases = [("", big)]
    if not args.no_mix:
        mix = [torch.randn(s, generator=gen).to(dev) for s in transformer_shapes()]
        cases.append(("mix", mix))

    rows = []
    for label, name, opts in chosen:
        for case, tensors in cases:
            fused = kernels.launched
            row = measure(label, make_codec(name, **opts), tensors, args.repeats)
            row["triton"] = kernels.launched > fused  # its Triton kernels ran (a GPU)
            row["case"] = case or f"{'x'.join(map(str, big_shape))}"
            rows.append(row)
            if not args.json:
                print(
                    f"{label:16s} {row['case']:12s} enc {row['encode_vs_copy']:.3f}x copy, "
                    f"dec {row['decode_vs_copy']:.3f}x, {row['wire_bits_per_param']:.3f} bits, "
                    f"err {row['rel_l2_error']:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}, "
            f"THP_MEM_ALLOC_ENABLE={thp}"
        )
        print(_table(rows))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
