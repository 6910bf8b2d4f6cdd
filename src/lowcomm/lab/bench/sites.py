"""``lowcomm bench sites``: sites of several ranks, each launched on its own as deployed, one lost
and brought back by its own command, against the same run uninterrupted.

Every site is a ``torchrun --nproc-per-node R`` (FSDP2 inside) in a network namespace of its own
whose uplink is token-bucket shaped (``--bandwidth``, each site's own link), the lighthouse in
the switch's namespace (:mod:`.deployed`). Per seed, two runs:

- ``uninterrupted``: no fault;
- ``lost and rejoined``: rank 1 of the last site SIGKILLed once that site has logged
  ``--kill-at`` syncs (torchrun takes the site down); its same command again at once.

Reported per run: wall time from outside (the first start to the last exit), the tokens that
reached the model (site 0's summary: a lost site's steps after its last sync do not count) and
goodput (their rate over that wall time), the final validation loss, and from the membership
record when the site left and joined, the survivors' resync and the heal's seconds and bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from .deployed import Deployment


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowcomm bench sites", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sync-every", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bandwidth", default="50mbit", help="each site's uplink, tc style")
    p.add_argument("--kill-at", type=int, default=3, help="syncs the last site logs first")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="runs/bench-sites")
    return p.parse_args(argv)


def _train(a: argparse.Namespace, seed: int) -> Any:
    def train(site: int, lighthouse: str) -> list[str]:
        return [
            "train",
            "--strategy",
            "diloco",
            "--model",
            a.model,
            "--steps",
            str(a.steps),
            f"sync_every={a.sync_every}",
            f"batch_size={a.batch_size}",
            f"seq_len={a.seq_len}",
            "progress=false",
            "eval_every=0",
            "threads=1",
            "elastic=true",
            "min_workers=2",
            "heartbeat_timeout_s=2",
            "timeout_s=60",
            f"seed={seed}",
            f"site={site}",
            f"sites={a.sites}",
            f"lighthouse={lighthouse}",
        ]

    return train


def run(a: argparse.Namespace, net: Any, seed: int, lose: bool) -> dict[str, Any]:
    """One run; its row."""
    name = "lost and rejoined" if lose else "uninterrupted"
    root = Path(a.out) / f"seed{seed}-{'lost' if lose else 'clean'}"
    d = Deployment(root, a.ranks, _train(a, seed), net, timeout_s=60)
    last = a.sites - 1
    t0 = time.monotonic()
    try:
        for s in range(a.sites):
            d.start(s)
        if lose:
            while d.syncs(last) < a.kill_at:
                if d.procs[last].poll() is not None:
                    raise RuntimeError(f"site {last} ended early:\n{d.log(last)[-2000:]}")
                time.sleep(0.1)
            pid = d.rank_pid(last, 1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            d.procs[last].wait()
            d.start(last)  # the same command, at once
        codes = [d.procs[s].wait() for s in range(a.sites)]
        wall = time.monotonic() - t0
    finally:
        d.close()
    if codes != [0] * a.sites:
        raise RuntimeError(f"{name}: exits {codes}:\n{d.log(codes.index(max(codes)))[-3000:]}")
    summary = json.loads((d.out(0) / "summary.json").read_text())
    events = summary.get("membership") or []
    return {
        "seed": seed,
        "run": name,
        "wall_s": round(wall, 1),
        "tokens": summary["tokens"],
        "goodput": round(summary["tokens"] / wall, 1),
        "final_val_loss": summary["final_val_loss"],
        "events": events,
        "bytes_sent_per_worker": summary.get("bytes_sent_per_worker"),
    }


def main(argv: list[str]) -> int:
    """Both runs per seed, one at a time; rows to OUT/results.json and a table printed."""
    from ..netshape.network import ShapedNetwork

    a = _args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rows = []
    with ShapedNetwork(
        a.bandwidth, topology="per-worker", workers=a.sites, name_prefix="lcbench"
    ) as net:
        print(
            f"lowcomm bench sites: {a.sites} sites x {a.ranks} ranks, each uplink "
            f"{a.bandwidth} (measured {net.measured_mbit} Mbit/s)",
            flush=True,
        )
        for seed in [int(s) for s in a.seeds.split(",")]:
            for lose in (False, True):
                rows.append({**run(a, net, seed, lose), "measured_mbit": net.measured_mbit})
                r = rows[-1]
                print(
                    f"seed {seed} {r['run']}: wall {r['wall_s']} s, tokens {r['tokens']}, "
                    f"goodput {r['goodput']:,.0f} tok/s, loss {r['final_val_loss']:.4f}, "
                    f"events {r['events']}",
                    flush=True,
                )
                (Path(a.out) / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0
