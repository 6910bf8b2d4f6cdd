"""`lowcomm bench sync --device cuda`: the GPU reference workload, every method against the
plain loop in the same process.

Your own loop (the README's pattern) around GPT-2 small (124M parameters, ``transformers``,
built from a config: nothing downloaded), bf16 autocast, fused AdamW, batches of random tokens
(8 x 512 by default). For each method in turn: the plain loop (no engine) for ``--warmup`` +
``--steps`` steps, then the same loop inside the method's ``with sync:`` block (its preset at
``--sync-every``, or at its own H with ``--preset-h``) for ``--warmup`` + H steps (through its
first sync, which allocates its buffers) and ``--steps`` timed steps, the device synchronised
at both ends, then the plain loop again. Reported per method:

- ``speed``: tokens/s as a ratio to the mean of the plain loop's just before and just after
  (the device drifts between phases about as much as the effects looked for);
- the sync's stages per sync (``engine.sync_times``, the device synchronised at each stage's
  edges for this benchmark only) and the sync's share of a round of H plain steps;
- with ``--launches``, kernel launches per sync: CUDA kernels, copies and fills
  (``torch.profiler``) of a round of ``PROFILED_H`` steps inside the block less those of as
  many plain steps, over the round's syncs, for the model and for one of half its layers (a
  sync on flat buffers launches as many for both), and the host synchronisations lowcomm's
  own lines made per sync (CUDA's sync debug mode);
- peak GPU memory over the plain loop's (the peak is reset before each phase).

Shapes: ``--world 1`` (an NCCL world of one: no wire, the sync's own work) and ``--world 2``
(two processes sharing the GPU over gloo, their tensors staged through pinned host memory).
``--diagnose METHODS`` profiles a round of each instead (host synchronisations by line, the
costliest operators).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.codecs import kernels

if TYPE_CHECKING:
    from lowcomm.engine import LowComm


def gpt2(layers: int, width: int, heads: int, seq: int, vocab: int = 50257) -> torch.nn.Module:
    """A GPT-2 causal LM from a config (GPT-2 small at 12 layers, width 768, 12 heads)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, n_positions=max(seq, 8), vocab_size=vocab
    )
    return GPT2LMHeadModel(cfg)


class Loop:
    """The user's loop: a model, fused AdamW, random token batches on the device."""

    def __init__(self, args: argparse.Namespace, layers: int, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = gpt2(layers, args.width, args.heads, args.seq, args.vocab).to(device)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.tensors = sum(1 for _ in self.model.parameters())
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=fused)
        vocab = self.model.config.vocab_size
        self.batch = torch.randint(0, vocab, (args.batch, args.seq), device=device)
        self.tokens_per_step = args.batch * args.seq

    def step(self) -> None:
        """One inner step: forward (bf16 autocast on the GPU), backward, optimizer."""
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        with autocast:
            loss = self.model(self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, steps: int) -> float:
        """Seconds of ``steps`` steps, the device's work included."""
        _settle(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        _settle(self.device)
        return time.perf_counter() - t0


def _settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _release(device: torch.device) -> None:
    """Free what the last engine held (its buffers may sit in reference cycles)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def plain(loop: Loop, args: argparse.Namespace) -> dict[str, float]:
    """The loop without lowcomm: tokens/s and peak memory."""
    _reset_peak(loop.device)
    loop.timed(args.warmup)
    seconds = loop.timed(args.steps)
    return {
        "s": seconds,
        "tok_s": args.steps * loop.tokens_per_step / seconds,
        "peak": _peak(loop.device),
    }


def method(loop: Loop, strategy: str, h: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same loop inside ``strategy``'s block at H = ``h``: speed, stages, memory."""
    _reset_peak(loop.device)
    engine = _engine(loop, strategy, h, args.state_device)
    engine.sync_times.on_device = loop.device.type == "cuda"
    with engine:
        # through one sync first: the first allocates the engine's buffers and plans
        loop.timed(args.warmup + h)
        before, syncs = engine.sync_times.stages(), engine.stats.syncs
        seconds = loop.timed(args.steps)
        after, done = engine.sync_times.stages(), engine.stats.syncs - syncs
        peak = _peak(loop.device)
    per_sync = {k: (after[k] - before[k]) / max(done, 1) for k in after}
    return {
        "s": seconds,
        "tok_s": args.steps * loop.tokens_per_step / seconds,
        "h": h,
        "state_device": args.state_device,
        "syncs": done,
        "stages_s": per_sync,
        "peak": peak,
    }


#: H of the profiled rounds: short, and a valid schedule for every preset on GPT-2 (Streaming's
#: fragments each land before the next is sent)
PROFILED_H = 10


def _engine(loop: Loop, strategy: str, h: int, state_device: str) -> LowComm:
    from lowcomm.engine import LowComm
    from lowcomm.presets import preset_config

    world = torch.distributed.get_world_size()
    cfg = preset_config(strategy, workers=world, sync_every=h, state_device=state_device)
    return LowComm(loop.model, loop.opt, cfg)


def _profiled_round(loop: Loop, engine: LowComm | None, cpu: bool = False) -> tuple[Any, int, list]:
    """One round of ``PROFILED_H`` steps (in ``engine``'s block when given) under the profiler
    and CUDA's sync debug mode: (profile, fragment syncs in it, the warnings it raised)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    syncs0 = engine.stats.fragment_syncs if engine is not None else 0
    _settle(loop.device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, profile(activities=activities) as p:
            warnings.simplefilter("always")
            for _ in range(PROFILED_H):
                loop.step()
            _settle(loop.device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = engine.stats.fragment_syncs - syncs0 if engine is not None else 0
    return p, syncs, list(caught)


def _engines(filename: str) -> bool:
    """Whether a line is lowcomm's own, not the lab's (this benchmark's loop, its settling)."""
    path = Path(filename).as_posix()
    return "/lowcomm/" in path and "/lowcomm/lab/" not in path


def _kernels(prof: Any) -> int:
    from torch.autograd import DeviceType

    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def launches_per_sync(loop: Loop, strategy: str, state_device: str) -> tuple[int, float] | None:
    """CUDA kernels, copies and fills per (fragment) sync: those of a round of PROFILED_H steps
    inside the block less those of as many plain steps, over the syncs the round made; and the
    host synchronisations lowcomm's lines made per sync (CUDA's sync debug mode)."""
    if loop.device.type != "cuda":
        return None
    loop.timed(2)  # a model's first steps launch set-up kernels (workspaces) a round does not
    plain_round, _, _ = _profiled_round(loop, None)
    with (engine := _engine(loop, strategy, PROFILED_H, state_device)):
        loop.timed(PROFILED_H)  # warm: the engine's buffers and the codecs' tables exist
        prof, syncs, caught = _profiled_round(loop, engine)
    ours = sum(1 for w in caught if _engines(w.filename))
    return round((_kernels(prof) - _kernels(plain_round)) / max(syncs, 1)), ours / max(syncs, 1)


def diagnose(loop: Loop, strategy: str, state_device: str, top: int = 25) -> dict[str, Any]:
    """Where a round's syncs spend their time on the device: the host synchronisations lowcomm
    made (CUDA's sync debug mode, by the line that made each) and the costliest operators
    (``torch.profiler``, by device and by self CPU time), over a round of PROFILED_H steps."""
    with (engine := _engine(loop, strategy, PROFILED_H, state_device)):
        loop.timed(PROFILED_H)
        prof, syncs, caught = _profiled_round(loop, engine, cpu=True)
    sites: dict[str, int] = {}
    for w in caught:  # attributed to the Python line that synchronised; lowcomm's only
        if _engines(w.filename):
            where = f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
            sites[where] = sites.get(where, 0) + 1
    averages = prof.key_averages()
    by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_dev = sorted(averages, key=lambda e: _device_us(e), reverse=True)[:top]

    def row(e: Any) -> dict[str, Any]:
        return {
            "name": e.key,
            "count": e.count,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "device_ms": _device_us(e) / 1e3,
        }

    return {
        "strategy": strategy,
        "syncs": syncs,
        "host_syncs": sum(sites.values()),
        "sync_sites": sites,
        "by_cpu": [row(e) for e in by_cpu],
        "by_device": [row(e) for e in by_dev],
    }


def _device_us(event: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def run(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Every method on this rank's loop; the rows (rank 0 reports them)."""
    device = torch.device(args.device)
    loop = Loop(args, args.layers, device)
    if args.diagnose and device.type == "cuda":
        diagnoses = [diagnose(loop, s, args.state_device) for s in args.diagnose.split(",")]
        return {"params": loop.params, "tensors": loop.tensors, "diagnoses": diagnoses}
    # the device's first seconds run slower (clocks, the allocator, kernel choices): spent
    # here, not on the first method's plain phase
    loop.timed(5 * args.warmup)
    rows = []
    for strategy in args.strategies.split(","):
        hs = [args.sync_every] + ([_preset_h(strategy)] if args.preset_h else [])
        for h in dict.fromkeys(hs):
            # the plain loop just before and just after: the device's own drift (clocks,
            # allocator) between phases is as large as the effects looked for
            before = plain(loop, args)
            fused = kernels.launched
            got = method(loop, strategy, h, args)
            got["triton_launches"] = kernels.launched - fused  # (0: the torch path ran)
            _release(loop.device)
            after = plain(loop, args)
            base_s = (before["s"] + after["s"]) / 2
            base_tok_s = args.steps * loop.tokens_per_step / base_s
            rows.append(
                {
                    "strategy": strategy,
                    **{k: v for k, v in got.items() if k != "peak"},
                    "plain_tok_s": base_tok_s,
                    "plain_tok_s_before_after": [before["tok_s"], after["tok_s"]],
                    "speed": got["tok_s"] / base_tok_s,
                    "sync_share_of_round": got["stages_s"]["total"] / (h * base_s / args.steps),
                    "extra_peak_bytes": got["peak"] - max(before["peak"], after["peak"]),
                }
            )
            if rank == 0:
                print(_line(rows[-1]), file=sys.stderr, flush=True)
    if args.launches and device.type == "cuda":
        half = Loop(args, max(1, args.layers // 2), device)
        for row in rows:
            full = launches_per_sync(loop, row["strategy"], args.state_device)
            halved = launches_per_sync(half, row["strategy"], args.state_device)
            assert full is not None and halved is not None
            row["launches_per_sync"], row["host_syncs_per_sync"] = full
            row["launches_per_sync_half_layers"] = halved[0]
        counts = {"tensors": loop.tensors, "tensors_half_layers": half.tensors}
    else:
        counts = {"tensors": loop.tensors}
    # whether Triton kernels ran in this worker (none on the CPU's state, or where they failed)
    return {"params": loop.params, **counts, "rows": rows, "triton": kernels.launched > 0}


def _preset_h(strategy: str) -> int:
    from lowcomm.presets import preset_config

    return preset_config(strategy).sync_every


def _line(r: dict[str, Any]) -> str:
    st = r["stages_s"]
    return (
        f"{r['strategy']:11s} H={r['h']:<3d} {r['speed']:.3f}x plain "
        f"({r['tok_s']:,.0f} vs {r['plain_tok_s']:,.0f} tok/s); per sync "
        f"{1e3 * st['total']:.1f} ms (encode {1e3 * st['encode']:.1f}, collective "
        f"{1e3 * st['collective']:.1f}, decode+sum {1e3 * st['decode_sum']:.1f}, outer "
        f"{1e3 * st['outer']:.1f}, merge {1e3 * st['merge']:.1f}), "
        f"{100 * r['sync_share_of_round']:.1f} % of a round"
    )


def table(result: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    head = (
        "| method | H | × plain | tok/s | plain tok/s | sync ms | encode | collective | "
        "decode+sum | outer | merge | % of round | launches/sync (½ layers) | "
        "host syncs/sync | extra peak MiB |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in result["rows"]:
        st = {k: 1e3 * v for k, v in r["stages_s"].items()}
        launches = r.get("launches_per_sync")
        half = r.get("launches_per_sync_half_layers")
        lines.append(
            f"| {r['strategy']} | {r['h']} | {r['speed']:.3f} | {r['tok_s']:,.0f} | "
            f"{r['plain_tok_s']:,.0f} | {st['total']:.1f} | {st['encode']:.1f} | "
            f"{st['collective']:.1f} | {st['decode_sum']:.1f} | {st['outer']:.1f} | "
            f"{st['merge']:.1f} | {100 * r['sync_share_of_round']:.2f} | "
            f"{launches if launches is not None else '-'} ({half if half is not None else '-'}) | "
            f"{_or_dash(r.get('host_syncs_per_sync'))} | "
            f"{r['extra_peak_bytes'] / 2**20:,.0f} |"
        )
    return "\n".join(lines)


def _or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from lowcomm.transport import shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "gloo" if world > 1 or args.device == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    if args.device.startswith("cuda"):  # both processes of --world 2 share this GPU
        torch.cuda.set_device(torch.device(args.device).index or 0)
    try:
        result = run(args, rank)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown()


def parser() -> argparse.ArgumentParser:
    """The options of the GPU workload."""
    from lowcomm.strategies import names

    ours = names(peers=False, per_step=False)
    p = argparse.ArgumentParser(prog="lowcomm bench sync --device cuda", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--world", type=int, default=1, help="1: NCCL world of one; 2: gloo, shared")
    p.add_argument("--strategies", default=",".join(ours), help="every outer-loop method")
    p.add_argument("--sync-every", type=int, default=50, help="H for every method")
    p.add_argument("--preset-h", action="store_true", help="also each preset's own H")
    p.add_argument("--steps", type=int, default=150, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument(
        "--state-device",
        choices=("model", "cpu"),
        default="model",
        help="where the sync's buffers live (cpu: host memory, the accelerator's saved)",
    )
    p.add_argument("--launches", action="store_true", help="count kernel launches per sync")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--diagnose", default="", help="methods whose round is profiled instead")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the workload on ``--world`` processes; print the table (or JSON)."""
    from .spawn import run_workers_json

    args = parser().parse_args(argv)
    result = run_workers_json(_worker, args.world, args)
    result.update(world=args.world, device=_device_name(args.device), torch=torch.__version__)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        speed = statistics.median(r["speed"] for r in result["rows"])
        print(
            f"{result['device']}, torch {result['torch']}, world {args.world}, "
            f"Triton kernels {'on' if result.get('triton') else 'off'}, "
            f"{result['params'] / 1e6:.1f}M parameters in {result['tensors']} tensors, "
            f"median speed {speed:.3f}"
        )
        print(table(result))
    return 0


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return device


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
