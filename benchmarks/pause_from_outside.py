"""The protocol issue's case, from outside: 4 sites of `tiny` DiLoCo (H = 10, 300 steps,
elastic, min_workers=2); once the run logs step STEP, site 2 is stopped with SIGSTOP from this
script and continued with SIGCONT 8 s later, as a GC pause or a VM migration would. Prints one
JSON row per run: uninterrupted, then paused under lock-step and under quorum rounds.

    python benchmarks/pause_from_outside.py OUT_DIR [STEP]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RUN = ["--strategy", "diloco", "--workers", "4", "--model", "tiny", "--steps", "300",
       "sync_every=10", "elastic=true", "min_workers=2", "progress=false"]  # fmt: skip


def step_reached(out: Path) -> int:
    """The newest step the run's metrics log holds (0 before the first)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.strip()]
    return max(steps, default=0)


def one(out: Path, extra: list[str], pause_at: int | None) -> dict:
    cmd = [sys.executable, "-m", "lowcomm.cli", "train", *RUN, *extra, "--out", str(out),
           "--overwrite"]  # fmt: skip
    t0 = time.monotonic()
    log = open(out.parent / f"{out.name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    paused = None
    while proc.poll() is None:
        if pause_at is not None and paused is None and step_reached(out) >= pause_at:
            pid = next(w["pid"] for w in json.loads((out / "workers.json").read_text())
                       if w["site"] == 2)  # fmt: skip
            os.kill(pid, signal.SIGSTOP)
            paused = step_reached(out)
            time.sleep(8)
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
    wall = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text()) if proc.returncode == 0 else {}
    said = [x for x in (out.parent / f"{out.name}.log").read_text().splitlines()
            if "site 2" in x and ("stops" in x or "gone" in x or "joined" in x)]  # fmt: skip
    return {"run": out.name, "exit": proc.returncode, "wall_s": round(wall, 1),
            "paused_at_step": paused, "final_val_loss": summary.get("final_val_loss"),
            "membership": summary.get("membership"), "site2": said[:3]}  # fmt: skip


def main() -> None:
    root = Path(sys.argv[1])
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    root.mkdir(parents=True, exist_ok=True)
    rows = [one(root / "uninterrupted", [], None),
            one(root / "lockstep-paused", [], step),
            one(root / "quorum-paused", ["rounds=quorum"], step)]  # fmt: skip
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
