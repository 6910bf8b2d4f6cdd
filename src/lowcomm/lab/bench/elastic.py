"""``lowcomm bench elastic``: one site lost a third of the way, three ways of living with it.

For each seed, behind one shaped link (a network namespace whose loopback is token-bucket
shaped; every site, and the lighthouse, inside it), the same run three times:

- ``uninterrupted``: no fault;
- ``elastic``: ``elastic=true``, the last site SIGKILLed before step ``kill_at``; the others
  finish the run;
- ``checkpoint-restart``: no membership, the same kill stops the run; it is resumed at once
  from its last checkpoint on the surviving sites (``--resume --workers M-1``);
- ``torchft uninterrupted`` and ``torchft elastic``: torchft's own DiLoCo (the
  ``torchft-diloco`` peer: its Managers on a lighthouse of their own) without and with the
  same kill, so it is judged against its own uninterrupted run.

Reported per run: wall time from outside (start to exit, the restart included), the tokens
that reached the model and goodput (their rate over that wall time), per surviving site,
``resync_s`` (the survivors' time from the fault to their next sync, from membership.jsonl)
and the final validation loss, beside the uninterrupted run's loss at the same tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

TRAIN = [sys.executable, "-m", "lowcomm.lab", "train"]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowcomm bench elastic", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=None, help="default: a third of --steps")
    p.add_argument("--sync-every", type=int, default=30)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--bandwidth", default="50mbit", help="'' for an unshaped run")
    p.add_argument("--out", default="runs/bench-elastic")
    p.add_argument("--cases", default=",".join(CASES), help=f"some of {','.join(CASES)}")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run every case for every seed; print the table (and write DIR/results.json)."""
    a = _args(argv)
    kill_at = a.kill_at or a.steps // 3
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--model",
        a.model,
        "--steps",
        str(a.steps),
        f"sync_every={a.sync_every}",
        "progress=false",
        f"eval_every={a.sync_every}",
        "threads=1",
        "--overwrite",
    ]
    cases = a.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown or "uninterrupted" not in cases:
        raise SystemExit(f"--cases: {unknown or 'uninterrupted is needed'}; choose from {CASES}")
    rows: list[dict[str, Any]] = []
    with _network(a.bandwidth) as wrap:
        for seed in [int(s) for s in a.seeds.split(",")]:
            args = [*common, f"seed={seed}"]
            these = [
                CASES[c](wrap, args, a.workers, kill_at, a, out / f"{c}-{seed}") for c in cases
            ]
            for r in these:
                r["seed"] = seed
            _equal_tokens(these)
            rows += these
            (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2) if a.json else table(rows))
    return 0


class _network:
    """Every command inside one shaped namespace (or as it is, unshaped)."""

    def __init__(self, bandwidth: str) -> None:
        self.bandwidth, self.net = bandwidth, None

    def __enter__(self) -> _network:
        if self.bandwidth:
            from ..netshape import ShapedNetwork

            self.net = ShapedNetwork(self.bandwidth, topology="shared", workers=1)
            self.net.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.net is not None:
            self.net.close()

    def __call__(self, argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
        cmd = self.net.command(0, argv) if self.net is not None else argv
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        return done, time.perf_counter() - t0


def _uninterrupted(
    wrap: _network,
    args: list[str],
    m: int,
    kill_at: int,
    a: argparse.Namespace,
    out: Path,
    strategy: str = "diloco",
    case: str = "uninterrupted",
) -> dict[str, Any]:
    done, wall = wrap(
        [*TRAIN, "--strategy", strategy, "--workers", str(m), *args, "--out", str(out)]
    )
    _check(done, out)
    s = json.loads((out / "summary.json").read_text())
    return _row(case, s, wall, m, out)


def _elastic(
    wrap: _network,
    args: list[str],
    m: int,
    kill_at: int,
    a: argparse.Namespace,
    out: Path,
    strategy: str = "diloco",
    case: str = "elastic",
    rejoin: bool = False,
) -> dict[str, Any]:
    faults = f"kill:{m - 1}@{kill_at}"
    if rejoin:  # the killed site starts again and joins at two thirds
        faults += f",join:{m - 1}@{2 * a.steps // 3}"
    fault = ["elastic=true", "min_workers=2", "--faults", faults]
    done, wall = wrap(
        [*TRAIN, "--strategy", strategy, "--workers", str(m), *args, *fault, "--out", str(out)]
    )
    _check(done, out)
    s = json.loads((out / "summary.json").read_text())
    events = s.get("membership", [])
    # per surviving site: the sites present on average over the run's steps
    per = s["config"]["batch_size"] * s["config"]["seq_len"]
    present = s["tokens"] / per / a.steps if rejoin else m - 1
    row = _row(case, s, wall, present, out)
    row["resync_s"] = max((e["resync_s"] for e in events if e["left"]), default=None)
    row["discarded_steps"] = sum(e.get("discarded_steps", 0) for e in events)
    heals = [e for e in events if e.get("joined")]
    if heals:
        row.update(
            joined_at=heals[0]["at"], heal_s=heals[0]["heal_s"], heal_bytes=heals[0]["heal_bytes"]
        )
    return row


def _restart(
    wrap: _network,
    args: list[str],
    m: int,
    kill_at: int,
    a: argparse.Namespace,
    out: Path,
    case: str = "checkpoint-restart",
    rejoin: bool = False,
) -> dict[str, Any]:
    """The kill stops the run; it resumes at once from its last checkpoint on the others.
    ``rejoin``: when the site is back (two thirds of the way) that run stops right after its
    next checkpoint, and all of them resume from it (a planned stop: no step is lost there)."""
    ckpt = f"checkpoint_every={a.sync_every}"
    first, wall1 = wrap(
        [
            *TRAIN,
            "--strategy",
            "diloco",
            "--workers",
            str(m),
            *args,
            ckpt,
            "--faults",
            f"kill:{m - 1}@{kill_at}",
            "--out",
            str(out),
        ]
    )
    if first.returncode == 0:
        raise RuntimeError(f"{case}: the killed run did not stop:\n{first.stdout}")
    back = -(-(2 * a.steps // 3) // a.sync_every) * a.sync_every  # the checkpoint after it
    stop = f"faults=kill:0@{back + 1}" if rejoin else "faults="
    again, wall2 = wrap([*TRAIN, "--resume", str(out), "--workers", str(m - 1), stop])
    resumed_at = _resumed_step(again.stdout)
    walls = [wall1, wall2]
    if rejoin:
        if again.returncode == 0:
            raise RuntimeError(f"{case}: the resumed run did not stop:\n{again.stdout}")
        third, wall3 = wrap([*TRAIN, "--resume", str(out), "--workers", str(m), "faults="])
        _check(third, out)
        walls.append(wall3)
        if _resumed_step(third.stdout) != back:
            raise RuntimeError(f"{case}: expected a resume from step {back}:\n{third.stdout}")
    else:
        _check(again, out)
        back = a.steps
    s = json.loads((out / "summary.json").read_text())
    per = s["config"]["batch_size"] * s["config"]["seq_len"]
    steps = resumed_at * m + (back - resumed_at) * (m - 1) + (a.steps - back) * m
    s["tokens"] = steps * per
    row = _row(case, s, sum(walls), steps / a.steps if rejoin else m - 1, out)
    row.update(resumed_from=resumed_at, run_s=[round(w, 1) for w in walls])
    return row


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "uninterrupted": _uninterrupted,
    "elastic": _elastic,
    "checkpoint-restart": _restart,
    "torchft-uninterrupted": partial(
        _uninterrupted, strategy="torchft-diloco", case="torchft-uninterrupted"
    ),
    "torchft-elastic": partial(_elastic, strategy="torchft-diloco", case="torchft-elastic"),
    "elastic-rejoin": partial(_elastic, case="elastic-rejoin", rejoin=True),
    "restart-rejoin": partial(_restart, case="restart-rejoin", rejoin=True),
}


def _resumed_step(stdout: str) -> int:
    """The step a resume started from, as ``lowcomm train --resume`` prints it."""
    for line in stdout.splitlines():
        if line.startswith("resuming") and "(step " in line:
            return int(line.split("(step ")[1].split(")")[0])
    raise RuntimeError(f"no 'resuming ... (step N)' line in:\n{stdout[-2000:]}")


def _check(done: subprocess.CompletedProcess, out: Path) -> None:
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _row(case: str, s: dict[str, Any], wall: float, survivors: float, out: Path) -> dict[str, Any]:
    tokens = int(s["tokens"])
    return {
        "case": case,
        "final_val_loss": s["final_val_loss"],
        "tokens": tokens,
        "wall_outside_s": round(wall, 2),
        "goodput": round(tokens / wall, 1),
        "goodput_per_surviving_site": round(tokens / wall / survivors, 1),
        "run_dir": str(out),
    }


def _equal_tokens(rows: list[dict[str, Any]]) -> None:
    """The uninterrupted run's validation loss at each faulty run's tokens (linear between its
    evaluations), for a loss comparison at equal tokens."""
    whole = next(r for r in rows if r["case"] == "uninterrupted")  # lowcomm's, for every row
    curve = []
    for line in (Path(whole["run_dir"]) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            curve.append((rec["tokens"], rec["val_loss"]))
    for r in rows:
        r["uninterrupted_loss_at_tokens"] = round(interp(curve, r["tokens"]), 4)


def interp(curve: list[tuple[float, float]], x: float) -> float:
    """The loss at ``x`` on ``curve`` (points in order), linear between them; past the end, the
    last one."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1] if curve else float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = (
        "| seed | case | final val loss | uninterrupted loss at its tokens | tokens | "
        "wall (outside) s | goodput tok/s | per surviving site | resync s |"
    )
    lines = [head, "|---" * 9 + "|"]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['case']} | {r['final_val_loss']:.4f} | "
            f"{r['uninterrupted_loss_at_tokens']:.4f} | {r['tokens']:,} | "
            f"{r['wall_outside_s']:.1f} | {r['goodput']:,.0f} | "
            f"{r['goodput_per_surviving_site']:,.0f} | {r.get('resync_s') or '-'} |"
        )
    return "\n".join(lines)
