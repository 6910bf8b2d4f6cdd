"""`lowcomm bench sync`: what one sync costs, stage by stage, against a round of H inner steps.

Every worker (a real process, gloo) builds the model and AdamW once, runs a few plain inner
steps (the reference without the engine), then wraps the same model in each strategy's preset
in turn (``preset_config(strategy, workers=M, sync_every=H)``) and runs warm-up plus measured
rounds of H inner steps. Only the first ``--inner-steps`` steps of a round compute gradients;
the others call ``optimizer.step()`` with no gradients, which moves nothing but still runs the
engine's hook, so the schedule, the pseudo-gradients (the real steps' progress) and every sync
are those of a real run while a round of a large model stays short. The real steps are the
inner-step reference, interleaved with the syncs so that machine noise hits both alike; the
ranks meet at a barrier after them, so that their noise does not reach the sync as one rank
waiting for another.

Stages come from ``engine.sync_times`` (deltas over a round, averaged over the ranks): encode
(pseudo-gradient, error compensation, codec encode), collective (the wire exchange, with its
control flags and module buffers, and a rank's wait for the slowest peer), decode_sum
(decoding the peers' payloads and averaging), outer (outer step on the global copy) and merge
(the result into the local weights). Strategies that overlap (streaming, CO2) run the
exchange on the engine's comm thread; the bench waits for that thread after every step, so an
exchange never runs under a timed inner step, and its stages are timed on the comm thread.
The total is the work of the round's syncs on both threads (``SyncTimes.total``);
ratio = total / (H x median inner step).

Against memory: ``work_s`` is a round's sync time less its collectives, ``floor_s`` the
model-sized passes the algebra needs (``bench.floor``) at the bandwidth of a plain copy of a
model-sized buffer timed in the same run, by every rank at once, before and after each
strategy; ``work_vs_floor`` is their ratio (docs/benchmarking.md §3).

Memory: the bytes of the tensors the engine holds (its ``state_dict()`` less the local
weights), as multiples of the model's FP32 size, and the peak RSS of the worker process with
the plain loop and with each engine (Linux: the peak is reset between phases through
``/proc/self/clear_refs``; elsewhere the process's lifetime peak is reported).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.engine.stats import SyncTimes
from lowcomm.transport import Transport

from .floor import FLOOR_STAGES, engine_floor
from .spawn import run_workers_json

if TYPE_CHECKING:
    from lowcomm.engine import LowComm

STAGES = SyncTimes.STAGES
DEFAULT_STRATEGIES = "diloco,streaming,sparseloco,co2"


# -- memory ------------------------------------------------------------------------------------
def reset_peak_rss() -> bool:
    """Restart the process's peak-RSS count at the current RSS (Linux); False if unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident memory of this process since the last reset (VmHWM), else its lifetime peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _release_memory() -> None:
    """Collect garbage and hand free heap pages back to the OS, so one phase's leftovers do
    not count in the next phase's peak."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may include freed pages
        pass


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested structure of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def engine_buffers(engine: LowComm) -> dict[str, int]:
    """Bytes of the tensors the engine keeps beside the model's own weights (which the plain
    loop has too), by state part (global copy, snapshot, outer state, error buffers, results
    in flight): the parts that declare themselves model-sized."""
    sd = engine.state_dict()
    return {k: tensor_bytes(sd[k]) for k in engine.state.names(buffer=True)}


# -- timing ------------------------------------------------------------------------------------
class HookClock:
    """Times the engine's own hook inside ``optimizer.step()``: one hook registered before the
    engine's (``start``) and one after it (``arm``, once the engine has entered)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt, self.t0, self.last = opt, 0.0, 0.0
        self.handles = [opt.register_step_post_hook(self._start)]

    def arm(self) -> None:
        """Register the closing hook; call after the engine registered its own."""
        self.handles.append(self.opt.register_step_post_hook(self._stop))

    def remove(self) -> None:
        """Remove both hooks."""
        for h in self.handles:
            h.remove()

    def _start(self, *_: Any) -> None:
        self.t0 = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.last = time.perf_counter() - self.t0


class Stepper:
    """One worker's model, optimizer and data: real inner steps and gradient-free ones."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        from lowcomm.train.build import build_model

        torch.manual_seed(0)
        self.model = build_model(args.model, max_seq_len=args.seq_len)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        # random tokens: a step's cost does not depend on the text, and no corpus to load
        self.vocab = self.model.embed.num_embeddings
        self.shape = (args.batch_size, args.seq_len + 1)
        self.gen = torch.Generator().manual_seed(rank)

    def real_step(self) -> float:
        """One forward, backward and optimizer step; returns its wall time."""
        tokens = torch.randint(self.vocab, self.shape, generator=self.gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        t0 = time.perf_counter()
        self.model(x, y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def idle_step(self) -> None:
        """``optimizer.step()`` with no gradients: the weights stay, the engine's hook runs."""
        self.opt.step()


def copy_seconds(numel: int, repeats: int = 3) -> list[float]:
    """Seconds of ``dst.copy_(src)`` over ``numel`` FP32 elements (one read and one write
    pass), ``repeats`` times after a touching copy; every rank runs it at once, as it syncs."""

    src = torch.randn(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    Transport().barrier()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(time.perf_counter() - t0)
    del src, dst
    _release_memory()
    return out


def _drain(engine: LowComm) -> None:
    """Wait for the engine's comm thread (an overlapped exchange) to finish its queue."""
    if engine.transport is not None:
        engine.transport.blocking(lambda: None)


def _round(engine: LowComm, st: Stepper, clock: HookClock, args: argparse.Namespace) -> tuple:
    """H inner steps (the first few real); returns (stage deltas, the real steps' times)."""

    before, inner = engine.sync_times.stages(), []
    for s in range(args.sync_every):
        if s < args.inner_steps:
            clock.last = 0.0
            dt = st.real_step()
            inner.append(dt - clock.last)  # less any sync work the engine did in this step
        else:
            if s == args.inner_steps:
                # the real steps' noise must not reach the sync as one rank waiting for another
                Transport().barrier()
            st.idle_step()
        _drain(engine)
    after = engine.sync_times.stages()
    return {k: after[k] - before[k] for k in after}, inner


def _across_ranks(rounds: list[dict], inner: list[float], peak: int, copies: list[float]) -> tuple:
    """Every rank's records: rounds averaged over ranks (a rank's collective holds its wait
    for the slowest peer), every rank's inner steps, each rank's round totals, the largest
    peak RSS, every rank's copy times."""

    got = Transport().all_gather_object((rounds, inner, peak, copies))
    mean = [
        {k: statistics.fmean(g[0][i][k] for g in got) for k in rounds[i]}
        for i in range(len(rounds))
    ]
    by_rank = [[r["total"] for r in g[0]] for g in got]
    every_copy = [t for g in got for t in g[3]]
    return mean, [t for g in got for t in g[1]], by_rank, max(g[2] for g in got), every_copy


def run_strategy(
    strategy: str, st: Stepper, args: argparse.Namespace, world: int, plain_peak: int
) -> dict[str, Any]:
    """Warm-up and measured rounds of one strategy; its stages, ratio and memory."""
    from lowcomm.engine import LowComm
    from lowcomm.presets import preset_config

    cfg = preset_config(strategy, workers=world, sync_every=args.sync_every)
    copies = copy_seconds(st.params)  # interleaved with the strategies: the same machine state
    _release_memory()
    reset_peak_rss()
    clock = HookClock(st.opt)
    engine = LowComm(st.model, st.opt, cfg)
    rounds, inner = [], []
    with engine:
        clock.arm()
        for r in range(args.warmup + args.repeats):
            stages, steps = _round(engine, st, clock, args)
            if r >= args.warmup:
                rounds.append(stages)
                inner += steps
        peak = peak_rss_bytes()
        held = engine_buffers(engine)
        floor = engine_floor(engine, world)
    clock.remove()
    copies += copy_seconds(st.params)
    rounds, inner, by_rank, peak, copies = _across_ranks(rounds, inner, peak, copies)
    model_bytes = 4 * st.params
    median_round = sorted(rounds, key=lambda d: d["total"])[(len(rounds) - 1) // 2]
    inner_s = statistics.median(inner)
    pass_s = statistics.median(copies) / 2  # a copy reads and writes: two passes
    work = statistics.median(r["total"] - r["collective"] for r in rounds)
    return {
        "overlap": cfg.overlap,
        "codec": cfg.codec,
        "fragments": len(engine.fragment_names),
        "exchange_thread": "comm" if engine.schedule.overlap > 0 else "caller",
        "stages_s": {s: median_round[s] for s in STAGES},
        "total_s": median_round["total"],
        "rounds": rounds,
        "total_s_by_rank": by_rank,
        "inner_step_median_s": inner_s,
        "inner_steps_measured": len(inner),
        "round_s": args.sync_every * inner_s,
        "ratio": median_round["total"] / (args.sync_every * inner_s),
        "copy_s": statistics.median(copies),
        "copy_gb_s": 8 * st.params / statistics.median(copies) / 1e9,
        "floor_passes": floor,
        "floor_s": floor["total"] * pass_s,
        "work_s": work,
        "work_vs_floor": work / (floor["total"] * pass_s),
        "stages_vs_floor": {
            s: median_round[s] / (floor[s] * pass_s) if floor[s] else None for s in FLOOR_STAGES
        },
        "buffers_bytes": held,
        "buffers_model_multiple": {k: v / model_bytes for k, v in held.items()},
        "extra_model_multiple": sum(held.values()) / model_bytes,
        "peak_rss_bytes": peak,
        "extra_peak_rss_bytes": peak - plain_peak,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from lowcomm.transport import shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    st = Stepper(args, rank)
    st.real_step()  # the optimizer's state exists before the plain loop's peak is taken
    _release_memory()
    resettable = reset_peak_rss()
    plain = [st.real_step() for _ in range(max(1, args.inner_steps))]
    plain_peak = peak_rss_bytes()
    strategies = {
        s: run_strategy(s, st, args, world, plain_peak) for s in args.strategies.split(",")
    }
    if rank == 0:
        res = {
            "model": args.model,
            "params": st.params,
            "model_fp32_bytes": 4 * st.params,
            "workers": world,
            "sync_every": args.sync_every,
            "warmup_rounds": args.warmup,
            "measured_rounds": args.repeats,
            "inner_steps_per_round": args.inner_steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "threads": args.threads,
            "torch": torch.__version__,
            "peak_rss_mode": "per phase (VmHWM reset)" if resettable else "process lifetime",
            "plain_inner_step_median_s": statistics.median(plain),
            "plain_peak_rss_bytes": plain_peak,
            "strategies": strategies,
        }
        Path(out).write_text(json.dumps(res))
    Transport().barrier()
    shutdown()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowcomm bench sync", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="base", help="model preset: tiny, small, base, 85m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=30, help="H: inner steps per round")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated presets")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds per strategy")
    p.add_argument("--warmup", type=int, default=2, help="rounds before the measured ones")
    p.add_argument(
        "--inner-steps", type=int, default=2, help="real inner steps per round (the reference)"
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--device", default="cpu", help="cpu; cuda runs the GPU reference workload")
    return p


def _table(res: dict[str, Any]) -> str:
    """The results as a markdown table (seconds per round, memory in model-sized multiples)."""
    mb = 2**20
    lines = [
        f"model {res['model']} ({res['params'] / 1e6:.2f}M parameters), {res['workers']} "
        f"workers, H = {res['sync_every']}, batch {res['batch_size']} x {res['seq_len']}, "
        f"{res['threads']} thread(s); plain inner step {res['plain_inner_step_median_s']:.4f} s, "
        f"plain peak RSS {res['plain_peak_rss_bytes'] / mb:.0f} MiB",
        "",
        "| strategy | exchange on | encode s | collective s | decode+sum s | outer s | merge s "
        "| total s | H x inner s | ratio | work s | floor s | work / floor "
        "| buffers (x model) | extra peak RSS MiB |",
        "|" + "---|" * 15,
    ]
    for name, r in res["strategies"].items():
        st = r["stages_s"]
        lines.append(
            f"| {name} | {r['exchange_thread']} | "
            + " | ".join(f"{st[s]:.4f}" for s in STAGES)
            + f" | {r['total_s']:.4f} | {r['round_s']:.3f} | {100 * r['ratio']:.2f}% | "
            f"{r['work_s']:.4f} | {r['floor_s']:.4f} | {r['work_vs_floor']:.2f}x | "
            f"{r['extra_model_multiple']:.2f} | {r['extra_peak_rss_bytes'] / mb:.0f} |"
        )
    return "\n".join(lines)


def _engine_preset(method: Any) -> bool:
    """Whether ``method`` (a Strategy or None) is one of the engine's own outer-loop presets."""
    return method is not None and not (method.per_step or method.peer)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a markdown table (or JSON); ``--device cuda``: the GPU
    reference workload instead (:mod:`lowcomm.lab.bench.gpu`)."""
    from lowcomm import strategies

    argv = sys.argv[1:] if argv is None else argv
    if _device_asked(argv) not in ("", "cpu"):
        from .gpu import main as on_device

        return on_device(argv)
    p = _parser()
    args = p.parse_args(argv)
    bad = [s for s in args.strategies.split(",") if not _engine_preset(strategies.find(s))]
    if bad:
        ours = strategies.names(peers=False, per_step=False)
        p.error(f"unknown strategies {bad}: choose from {', '.join(ours)}")
    if min(args.workers, args.sync_every, args.repeats, args.inner_steps) < 1 or args.warmup < 0:
        p.error("--workers, --sync-every, --repeats, --inner-steps must be >= 1, --warmup >= 0")
    if args.inner_steps > args.sync_every:
        p.error("--inner-steps cannot exceed --sync-every")
    from lowcomm.train.model import PRESETS, unknown_preset

    if args.model not in PRESETS:  # found here, not in every worker
        p.error(unknown_preset(args.model))
    res = run_workers_json(_worker, args.workers, args)
    print(json.dumps(res, indent=1) if args.json else _table(res))
    return 0


def _device_asked(argv: list[str]) -> str:
    """The value of ``--device`` in ``argv`` ("" without one)."""
    for i, a in enumerate(argv):
        if a.startswith("--device="):
            return a.split("=", 1)[1]
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
