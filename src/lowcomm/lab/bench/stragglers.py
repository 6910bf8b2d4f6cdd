"""``lowcomm bench stragglers``: one site slower than the others, lock-step against quorum rounds.

For each strategy and seed, the same run three ways (every site an elastic site, fault harness
``slow:SITExFACTOR``: the slow site sleeps (FACTOR - 1) times its step's compute after each
step, so on a machine with fewer cores than sites it frees the CPU rather than takes it):

- ``lockstep``: ``rounds=lockstep``: every sync waits for the slow site;
- ``quorum``: ``rounds=quorum`` (``quorum=`` default: all sites but one) with the default
  grace; the slow site cuts its rounds short and is weighted by the steps it took;
- ``removed``: the same run without the slow site (one site fewer, no fault).

``--weightings steps,plain,normalized``: the quorum case alone, once per merge rule for
contributions of unequal steps (``weighting=``), each row its final validation loss; the rule
with the lowest mean over the seeds is the one to ship (docs/algorithms.md).

Reported per run: wall time from outside (start to exit), the tokens trained, goodput (their
rate over the training loop's elapsed time), the final validation loss, the loss at equal
wall-clock (each run's evaluations interpolated at the quorum run's final elapsed time), and
the elapsed time to a target loss (the worse of the lock-step and quorum final losses, so both
reach it; interpolated between evaluations, one every round). Times are the records'
``elapsed_s``: since the training loop began, waits at the trainer's own collectives
included (``wall_s``, the timed steps only, leaves out a fast site's wait for a slow one at
logging and evaluation).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .elastic import interp

TRAIN = [sys.executable, "-m", "lowcomm.lab", "train"]
CASES = ("lockstep", "quorum", "removed")
STRATEGIES = {
    "diloco": [],
    "streaming": ["fragments=2", "overlap=1"],
    "sparseloco": [],
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowcomm bench stragglers", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--sync-every", type=int, default=30)
    p.add_argument("--slow", default="3x2", help="SITExFACTOR: which site, how many times slower")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="runs/bench-stragglers")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--weightings", default="", help="e.g. steps,plain,normalized: quorum only")
    p.add_argument("--set", default="", help="settings added to every run, e.g. outer_lr=1.0")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run every case for every strategy and seed; print the table (DIR/results.json too)."""
    a = _args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if a.weightings:
        return _weightings(a, out)
    for strategy in a.strategies.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            these = [_case(c, strategy, seed, a, out / f"{strategy}-{c}-{seed}") for c in CASES]
            _compare(these)
            rows += these
            (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")  # as they end
    print(json.dumps(rows, indent=2) if a.json else table(rows))
    return 0


def _weightings(a: argparse.Namespace, out: Path) -> int:
    """The quorum case once per weighting rule, strategy and seed; the rows and a table of
    each rule's final loss (mean and each seed)."""
    rows: list[dict[str, Any]] = []
    for strategy in a.strategies.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            for rule in a.weightings.split(","):
                run = out / f"{strategy}-{rule}-{seed}"
                row = _case("quorum", strategy, seed, a, run, (f"weighting={rule}",))
                rows.append({**row, "weighting": rule})
                (out / "weightings.json").write_text(json.dumps(rows, indent=2) + "\n")
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| strategy | weighting | final val loss (mean) | by seed | tokens (mean) |")
    print("|---|---|---|---|---|")
    for strategy in a.strategies.split(","):
        for rule in a.weightings.split(","):
            these = [r for r in rows if r["strategy"] == strategy and r["weighting"] == rule]
            losses = [r["final_val_loss"] for r in these]
            print(
                f"| {strategy} | {rule} | {sum(losses) / len(losses):.4f} | "
                f"{' / '.join(f'{x:.4f}' for x in losses)} | "
                f"{sum(r['tokens'] for r in these) // len(these):,} |"
            )
    return 0


def _case(
    case: str,
    strategy: str,
    seed: int,
    a: argparse.Namespace,
    out: Path,
    extra: tuple[str, ...] = (),
) -> dict:
    """One run of ``case`` (``extra``: settings added to it); its row."""
    workers = a.workers - 1 if case == "removed" else a.workers
    args = [
        "--strategy",
        strategy,
        "--model",
        a.model,
        "--workers",
        str(workers),
        "--steps",
        str(a.steps),
        f"sync_every={a.sync_every}",
        f"eval_every={a.sync_every}",
        "progress=false",
        "threads=1",
        f"seed={seed}",
        "elastic=true",
        "--overwrite",
        "--out",
        str(out),
        *STRATEGIES[strategy],
    ]
    if case != "removed":
        args += ["--faults", f"slow:{a.slow}", f"rounds={case}"]
    if case == "quorum":
        args.append(f"quorum={a.workers - 1}")
    args += [*extra, *a.set.split()]
    t0 = time.perf_counter()
    done = subprocess.run(TRAIN + args, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    curve = [  # elapsed time since the loop began: waits at logging collectives count too
        (rec["elapsed_s"], rec["val_loss"])
        for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in rec and "elapsed_s" in rec
    ]
    return {
        "strategy": strategy,
        "seed": seed,
        "case": case,
        "command": "lowcomm train " + " ".join(args),
        "final_val_loss": s["final_val_loss"],
        "tokens": int(s["tokens"]),
        "wall_outside_s": round(wall, 2),
        # the training loop's elapsed time on the writing site, to its final evaluation
        "train_wall_s": round(curve[-1][0] if curve else s["wall_s"], 2),
        "goodput": round(int(s["tokens"]) / (curve[-1][0] if curve else s["wall_s"]), 1),
        "rounds": s.get("rounds"),
        "curve": curve,
    }


def _compare(rows: list[dict[str, Any]]) -> None:
    """Loss at the quorum run's final wall time, and time to the target loss, per row."""
    lock = next(r for r in rows if r["case"] == "lockstep")
    quorum = next(r for r in rows if r["case"] == "quorum")
    at = quorum["train_wall_s"]
    target = max(lock["final_val_loss"], quorum["final_val_loss"])
    for r in rows:
        r["loss_at_quorum_wall"] = round(interp(r["curve"], at), 4)
        r["target_loss"] = round(target, 4)
        r["time_to_target_s"] = _first_below(r["curve"], target)


def _first_below(curve: list[tuple[float, float]], target: float) -> float | None:
    """The wall time at which the loss first reaches ``target`` (linear between evaluations)."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if y0 > target >= y1:
            return round(x0 + (x1 - x0) * (y0 - target) / (y0 - y1), 2)
    return round(curve[0][0], 2) if curve and curve[0][1] <= target else None


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = (
        "| strategy | seed | case | final val loss | loss at quorum's wall | time to target s "
        "(target) | tokens | train wall s | wall (outside) s | goodput tok/s |"
    )
    lines = [head, "|---" * 10 + "|"]
    for r in rows:
        ttt = r["time_to_target_s"]
        lines.append(
            f"| {r['strategy']} | {r['seed']} | {r['case']} | {r['final_val_loss']:.4f} | "
            f"{r['loss_at_quorum_wall']:.4f} | {'-' if ttt is None else ttt} "
            f"({r['target_loss']:.4f}) | {r['tokens']:,} | {r['train_wall_s']:.1f} | "
            f"{r['wall_outside_s']:.1f} | {r['goodput']:,.0f} |"
        )
    return "\n".join(lines)
