"""`lowcomm bench overhead`: step time with the engine vs the same plain loop, side by side.

Each worker holds two identical models: one trained by a plain loop, one inside the engine.
Their steps alternate (plain, engine, plain, engine, ...) so both see the same machine noise.
Steps where the engine syncs are reported apart (the sync step's own cost); the overhead
outside sync steps is the ratio of median step times.
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

import torch

from .spawn import run_workers_json


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    from lowcomm.engine import LowComm
    from lowcomm.presets import preset_config
    from lowcomm.train.build import build_model
    from lowcomm.train.data import Batches, load_corpus
    from lowcomm.transport import shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    corpus = load_corpus("stdlib")
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        m = build_model(args.model, max_seq_len=args.seq_len)
        models.append(m)
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-3))
    data = Batches(corpus.train, args.batch_size, args.seq_len, rank, world, seed=0)
    engine = LowComm(models[1], opts[1], preset_config("diloco", sync_every=args.sync_every))
    times: dict[str, list[float]] = {"plain": [], "engine": [], "engine_sync": []}
    with engine:
        for step in range(1, args.steps + 1):
            x, y = data.next()
            for which in (0, 1):
                t0 = time.perf_counter()
                models[which](x, y).backward()
                opts[which].step()
                opts[which].zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                if step <= args.warmup:
                    continue
                if which == 0:
                    times["plain"].append(dt)
                else:
                    synced = step % args.sync_every == 0
                    times["engine_sync" if synced else "engine"].append(dt)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a markdown table (or JSON)."""
    p = argparse.ArgumentParser(prog="lowcomm bench overhead")
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sync-every", type=int, default=100, help="H; sync steps are reported apart")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    times = run_workers_json(_worker, args.workers, args)
    plain = statistics.median(times["plain"])
    eng = statistics.median(times["engine"])
    sync = statistics.median(times["engine_sync"]) if times["engine_sync"] else float("nan")
    res = {
        "model": args.model,
        "workers": args.workers,
        "sync_every": args.sync_every,
        "steps_measured": len(times["plain"]),
        "plain_median_s": plain,
        "engine_median_s": eng,
        "overhead_outside_sync": eng / plain - 1,
        "plain_mean_s": statistics.fmean(times["plain"]),
        "engine_mean_s": statistics.fmean(times["engine"]),
        "sync_steps": len(times["engine_sync"]),
        "sync_step_median_s": sync,
        "sync_step_extra_s": sync - plain,
    }
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print("| measure | plain loop | with engine | ratio |\n|---|---|---|---|")
        print(f"| median step s (outside syncs) | {plain:.5f} | {eng:.5f} | {eng / plain:.4f} |")
        print(
            f"| mean step s (outside syncs) | {res['plain_mean_s']:.5f} | "
            f"{res['engine_mean_s']:.5f} | "
            f"{res['engine_mean_s'] / res['plain_mean_s']:.4f} |"
        )
        print(
            f"| sync step s (median of {res['sync_steps']}) | {plain:.5f} | {sync:.5f} | "
            f"{sync / plain:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
