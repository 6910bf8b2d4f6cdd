"""``lowcomm bench heal``: what it costs to bring a site back, per model size.

For each model, on this machine (unshaped loopback), two sites of DiLoCo:

- **heal**: ``elastic=true``, site 1 killed and joining again (``kill:1@K,join:1@J``): the
  shared state's bytes and the seconds of the hand-over, digests compared (``heal_s``, as the
  sending site measured it: the pause the run takes at the sync that admits the joiner);
- **checkpoint-restart**: the stop-the-world way to bring a site back. A run writes a
  checkpoint (its writing time is read from the run's own clock), then ``lowcomm train
  --resume`` starts every site again with one step left; its wall time from outside (start,
  load, one step, the end) is the restart.

Both are small runs (batch 2 x 32 tokens) so the 85m model fits two cores; the figures are the
costs of moving and loading state, not of training.

``--members 2,3,4``: time to heal against the number of members instead. For each count N,
N + 1 sites, the last killed and joining again, so N members heal it; with ``--link RATE``
every site runs in a namespace of its own on a link of that rate (``site_link=``: root). The
state goes to the joiner only, striped across the N members (``heal_from``), so its time
should stay that of one copy over the joiner's link, whatever N.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TRAIN = [sys.executable, "-m", "lowcomm.lab", "train"]
SMALL = [
    "batch_size=2",
    "seq_len=32",
    "eval_every=0",
    "progress=false",
    "threads=1",
    "--overwrite",
    "eval_batches=1",
]


def main(argv: list[str]) -> int:
    """Measure heal and restart for each model; print the table (and write DIR/results.json)."""
    p = argparse.ArgumentParser(prog="lowcomm bench heal", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,small,85m")
    p.add_argument("--out", default="runs/bench-heal")
    p.add_argument("--json", action="store_true")
    p.add_argument("--members", default="", help="e.g. 2,3,4: heal time against members")
    p.add_argument("--link", default="", help="with --members: each site's link rate (root)")
    a = p.parse_args(argv)
    from lowcomm.train.model import PRESETS, unknown_preset

    for model in a.models.split(","):
        if model not in PRESETS:  # found here, not in a worker's traceback
            p.error(unknown_preset(model))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.members:
        return _by_members(a, out)
    rows = []
    for model in a.models.split(","):
        rows.append(
            {
                "model": model,
                **_heal(model, out / f"heal-{model}"),
                **_restart(model, out / f"restart-{model}"),
            }
        )
        (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2) if a.json else table(rows))
    return 0


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    done = subprocess.run([*TRAIN, *args], capture_output=True, text=True)
    if done.returncode != 0 and "--resume" not in args:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done, time.perf_counter() - t0


def _heal(model: str, out: Path) -> dict[str, Any]:
    _run(
        [
            "--strategy",
            "diloco",
            "--workers",
            "2",
            "--model",
            model,
            "--steps",
            "8",
            "sync_every=2",
            *SMALL,
            "elastic=true",
            "min_workers=1",
            "--faults",
            "kill:1@3,join:1@6",
            "--out",
            str(out),
        ]
    )
    events = json.loads((out / "summary.json").read_text())["membership"]
    (joined,) = [e for e in events if e.get("joined")]
    return {"heal_s": joined["heal_s"], "heal_bytes": joined["heal_bytes"]}


def _by_members(a: argparse.Namespace, out: Path) -> int:
    """Heal time against the number of members healing one joiner (see the module's text)."""
    rows = []
    link = [f"site_link={a.link}"] if a.link else []
    for model in a.models.split(","):
        for n in [int(x) for x in a.members.split(",")]:
            run = out / f"members-{model}-{n}"
            _run(
                [
                    "--strategy",
                    "diloco",
                    "--workers",
                    str(n + 1),
                    "--model",
                    model,
                    "--steps",
                    "8",
                    "sync_every=2",
                    *SMALL,
                    "elastic=true",
                    "min_workers=1",
                    *link,
                    "--faults",
                    f"kill:{n}@3,join:{n}@6",
                    "--out",
                    str(run),
                ]
            )
            events = json.loads((run / "summary.json").read_text())["membership"]
            (joined,) = [e for e in events if e.get("joined")]
            measured = {k: joined[k] for k in ("heal_s", "heal_bytes", "heal_from")}
            rows.append({"model": model, "members": n, "link": a.link or "loopback", **measured})
            (out / "members.json").write_text(json.dumps(rows, indent=2) + "\n")
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| model | link | members | sent by | heal bytes | heal s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['link']} | {r['members']} | {r['heal_from']} | "
            f"{r['heal_bytes']:,} | {r['heal_s']:.3f} |"
        )
    return 0


def _restart(model: str, out: Path) -> dict[str, Any]:
    base = ["--strategy", "diloco", "--workers", "2", "--model", model, *SMALL]
    _run([*base, "--steps", "4", "sync_every=2", "checkpoint_every=2", "--out", str(out)])
    write_s = json.loads((out / "summary.json").read_text())["checkpoint_s"] / 2  # two written
    done, wall = _run(["--resume", str(out), "--steps", "5"])
    if done.returncode != 0:
        raise RuntimeError(f"resume failed:\n{done.stderr[-3000:]}")
    return {"checkpoint_write_s": round(write_s, 3), "restart_s": round(wall, 2)}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = "| model | heal bytes | heal s | checkpoint write s | restart s (start, load, 1 step) |"
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['heal_bytes']:,} | {r['heal_s']:.3f} | "
            f"{r['checkpoint_write_s']:.3f} | {r['restart_s']:.2f} |"
        )
    return "\n".join(lines)
