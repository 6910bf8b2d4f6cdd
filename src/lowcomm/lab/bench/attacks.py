"""``lowcomm bench attacks``: the attack matrix: bad sites against each combine rule.

For each strategy, seed and combine rule (``aggregation=``; ``auto`` is the plain rule: the mean,
or the selected mean for SparseLoCo's top-k): one clean run, and one per attack (``--faults``,
acted out by the bad sites on every contribution they send from step 1) and number of bad
sites (the last ones). ``absent`` is the control an attack is also compared with: a clean run
without the bad sites at all (what a perfect defence that spotted them would leave). Every
cell runs on the gather exchange (what the robust rules and the forged attacks need; the plain
mean computes the same there). A rule not defined for a
strategy's codec (the coordinate-wise rules on top-k) is refused by the config with one line,
and its cells say so.

Reported per cell: the final validation loss over the clean run with the plain rule (the
ratio a user pays), "stopped" for a run that stopped (a NaN merged into the model stops it at
its next syncs) and "diverged" for a loss above ``--diverged`` times the clean one. Every row
has its command. Sizing on 2 cores: 8 sites of ``tiny`` take about a minute a run; screen
with one seed, then repeat the cells that decide with more.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TRAIN = [sys.executable, "-m", "lowcomm.lab", "train"]
ATTACKS = {
    "none": "",
    "signflip": "signflip:{s}",
    "scale": "scale:{s}x1000",
    "noise": "noise:{s}x2",
    "zero": "zero:{s}",
    "nan": "nan:{s}",
    "copy": "copy:{s}",
    "alie": "alie:{s}",
    "drift": "drift:{s}",
    "collude": "collude:{s}",
    "absent": "",  # the control: the bad sites not there at all (workers - bad sites, clean)
}
RULES = (
    "auto",
    "norm-clip",
    "cosine-clip",
    "share-clip",
    "trimmed-mean",
    "median",
    "centered-clip",
)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowcomm bench attacks", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--strategies", default="diloco,sparseloco")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--bad", default="1,2,3", help="how many sites attack (the last ones)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--seeds", default="0")
    p.add_argument("--diverged", type=float, default=1.5, help="loss ratio called diverged")
    p.add_argument("--out", default="runs/bench-attacks")
    p.add_argument("--set", default="", help="settings added to every run, e.g. outer_lr=0.5")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run every cell; print the matrix (DIR/results.json holds the rows as they end)."""
    a = _args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(a.attacks.split(",")) - set(ATTACKS))
    if unknown:
        raise SystemExit(f"lowcomm bench attacks: unknown attacks {unknown}: use {list(ATTACKS)}")
    rows: list[dict[str, Any]] = []
    for strategy in a.strategies.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            for rule in a.rules.split(","):
                for attack in a.attacks.split(","):
                    for bad in [0] if attack == "none" else [int(b) for b in a.bad.split(",")]:
                        rows.append(_cell(a, strategy, seed, rule, attack, bad, out))
                        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows, a.diverged))
    return 0


def _cell(
    a: argparse.Namespace, strategy: str, seed: int, rule: str, attack: str, bad: int, out: Path
) -> dict[str, Any]:
    """One run; its row (``loss`` None when it stopped or was refused)."""
    name = f"{strategy}-{rule}-{attack}{bad}-s{seed}"
    sites = range(a.workers - bad, a.workers)
    faults = ",".join(ATTACKS[attack].format(s=s) for s in sites if ATTACKS[attack])
    workers = a.workers - bad if attack == "absent" else a.workers
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
        f"eval_every={a.steps}",
        "progress=false",
        "threads=1",
        f"seed={seed}",
        f"aggregation={rule}",
        "reduce=gather",
        "--overwrite",
        "--out",
        str(out / name),
        *a.set.split(),
    ]
    if faults:
        args += ["--faults", faults]
    t0 = time.perf_counter()
    done = subprocess.run(TRAIN + args, capture_output=True, text=True)
    row: dict[str, Any] = {
        "strategy": strategy,
        "seed": seed,
        "rule": rule,
        "attack": attack,
        "bad": bad,
        "exit": done.returncode,
        "loss": None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "command": "lowcomm train " + " ".join(args),
    }
    summary = out / name / "summary.json"
    if done.returncode == 0 and summary.exists():
        loss = json.loads(summary.read_text()).get("final_val_loss")
        row["loss"] = loss if loss is not None and math.isfinite(loss) else None
    else:
        lines = (done.stderr or done.stdout).strip().splitlines()
        row["why"] = lines[-1][:200] if lines else ""
        # refused by the checks (exit 2, before any step: no metrics), not stopped on the way
        row["refused"] = done.returncode == 2 and not (out / name / "metrics.jsonl").exists()
    print(f"{name}: exit {done.returncode}, loss {row['loss']}", flush=True)
    return row


def table(rows: list[dict[str, Any]], diverged: float) -> str:
    """Per strategy: a row per attack and bad count, a column per rule; each cell the final
    loss over the clean plain-rule run (mean over seeds), or what stopped it."""
    lines = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        rules = list(dict.fromkeys(r["rule"] for r in mine))
        clean = [r["loss"] for r in mine if r["rule"] == "auto" and r["attack"] == "none"]
        base = sum(x for x in clean if x) / max(1, len([x for x in clean if x])) if clean else None
        lines += [
            f"\n{strategy} (clean, plain rule: {base if base is None else round(base, 4)})",
            "| attack | bad | " + " | ".join(rules) + " |",
            "|---|---|" + "---|" * len(rules),
        ]
        for attack, bad in dict.fromkeys((r["attack"], r["bad"]) for r in mine):
            here = [r for r in mine if r["attack"] == attack and r["bad"] == bad]
            cells = [
                _cell_text([r for r in here if r["rule"] == rule], base, diverged) for rule in rules
            ]
            lines.append(f"| {attack} | {bad} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell_text(runs: list[dict[str, Any]], base: float | None, diverged: float) -> str:
    if not runs:
        return ""
    if any(r.get("refused") for r in runs):
        return "refused"
    losses = [r["loss"] for r in runs]
    if any(x is None for x in losses):
        return "stopped"
    mean = sum(losses) / len(losses)
    if base is None:
        return f"{mean:.4f}"
    ratio = mean / base
    return f"{ratio:.3f}" + (" diverged" if ratio > diverged else "")
