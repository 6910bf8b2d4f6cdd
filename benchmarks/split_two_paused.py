"""Quorum rounds with two sites paused together: can the two form a sync of their own?

5 sites of `tiny` DiLoCo, `rounds=quorum` (a sync closes on 3 of 5; lock-step is the control),
`min_workers=2`, keyed by a run secret; sites 2 and 3 are stopped (SIGSTOP) before step
PAUSE_AT for PAUSE_S seconds, longer than the 2 s a peer's hint write waits. The other three
close the sync without them; the question is whether the two, back, see it closed (and skip
it, late) or meet at the lighthouse and merge only each other's work under the same sync (a
split: two models). Prints one JSON row per run: the steps at which the sites' global copies
differ, the sites' membership lines, and the membership of the run's summary (whoever wrote
it last: with `model.pt`, the run's output).

    python benchmarks/split_two_paused.py OUT_DIR [RUNS] [PAUSE_AT] [PAUSE_S] [ROUNDS] [STEPS]

(ROUNDS: quorum, the default, or lockstep; STEPS: 60, over before the two are back.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUN = ["--strategy", "diloco", "--workers", "5", "--model", "tiny", "sync_every=10",
       "batch_size=4", "seq_len=64", "eval_every=0", "progress=false",
       "elastic=true", "min_workers=2", "heartbeat_timeout_s=1", "timeout_s=10"]  # fmt: skip


def splits(out: Path) -> dict[int, dict[str, str]]:
    """Each step at which the sites that logged it hold different global copies."""
    by_step: dict[int, dict[str, str]] = {}
    for f in sorted((out / "sites").glob("site?.syncs.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], {})[f.name.split(".")[0]] = row["theta"]
    return {s: t for s, t in sorted(by_step.items()) if len(set(t.values())) > 1}


def one(out: Path, pause_at: int, pause_s: int, rounds: str, steps: int) -> dict:
    """One run; its splits, exit status and membership lines."""
    secret = out.parent / "secret"
    if not secret.exists():
        secret.write_text(os.urandom(16).hex())
    faults = f"pause:2@{pause_at}x{pause_s},pause:3@{pause_at}x{pause_s}"
    cmd = [sys.executable, "-m", "lowcomm.lab", "train", *RUN, "--steps", str(steps),
           f"rounds={rounds}", f"secret_file={secret}",
           "--faults", faults, "--out", str(out), "--overwrite"]  # fmt: skip
    t0 = time.monotonic()
    with open(out.parent / f"{out.name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    text = (out.parent / f"{out.name}.log").read_text()
    lines = [x for x in text.splitlines() if " left at " in x or " late for " in x]
    writer = json.loads((out / "summary.json").read_text()).get("membership", [])
    return {"run": out.name, "rounds": rounds, "steps": steps, "faults": faults, "exit": rc,
            "wall_s": round(time.monotonic() - t0, 1), "splits": splits(out),
            "membership": lines, "summary_membership": writer}  # fmt: skip


def main() -> None:
    root = Path(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    pause_at = int(sys.argv[3]) if len(sys.argv) > 3 else 25
    pause_s = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    rounds = sys.argv[5] if len(sys.argv) > 5 else "quorum"
    steps = int(sys.argv[6]) if len(sys.argv) > 6 else 60
    root.mkdir(parents=True, exist_ok=True)
    for i in range(runs):
        row = one(root / f"{rounds}{steps}-{i}", pause_at, pause_s, rounds, steps)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
