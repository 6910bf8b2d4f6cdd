"""The trust issue's three findings, from outside, with nothing of the project's fault grammar:
three sites launched per site on loopback (DiLoCo, `tiny`, 200 steps, H = 10, min_workers=2,
timeout_s=30, one secret file), `lowcomm lighthouse` standalone, and one extra process or one
patched site:

- clean: no attack (the control);
- flood: a stranger asks the lighthouse as site 1 from 8 threads, with empty data, from the
  sites' start for 60 s (torchft's own LighthouseClient);
- swarm: the flood from 400 threads (more than the front's 256), for 60 s;
- junk: the same stranger asks once as site 9 with data claiming the run (its id, a bad MAC)
  before the sites start;
- liar: site 2 runs with `lowcomm.engine.guards.global_checksum` patched to a constant;
- kill: site 2 SIGKILLed from outside after its 5th sync (300 steps; the lighthouse with its
  default join wait and heartbeat timeout, as `lowcomm lighthouse --secret-file F --run-id R`
  starts it): the control of
- beats: the same kill, and from then a stranger calling torchft's own
  `LighthouseClient.heartbeat` under site 2's name every 0.2 s.

Prints one JSON row per case: each site's exit code, wall seconds, final validation loss,
whether the models of the sites that finished are equal, and the last line of any site that
stopped.

    python benchmarks/trust_from_outside.py OUT_DIR [CASE ...]

The lighthouse is given the secret and the run's id too (`--secret-file`, `--run-id`: its front
refuses what is not sealed under it for this run); `NO_FRONT=1` runs a bare one, as before the
front existed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

RUN_ID = "trust"
# the lighthouse behind its authenticating front (`--secret-file`, `--run-id`); NO_FRONT=1:
# a bare one
FRONT = not os.environ.get("NO_FRONT")
SITE = ["train", "--strategy", "diloco", "--model", "tiny", "--steps", "200", "sync_every=10",
        "elastic=true", "min_workers=2", "timeout_s=30", "heartbeat_timeout_s=2",
        "progress=false", "eval_every=0", "threads=1", "sites=3", f"run_id={RUN_ID}"]  # fmt: skip
LIAR = (
    "import sys, lowcomm.engine.guards as g; g.global_checksum = lambda frags: 12345; "
    "from lowcomm.cli import main; sys.exit(main(sys.argv[1:]))"
)


def lighthouse(port: int, secret: Path | None, defaults: bool = False) -> subprocess.Popen:
    """`lowcomm lighthouse` on ``port`` (behind its front with ``secret``), answering;
    ``defaults``: its own timeouts (else 30 s and 2 s)."""
    keyed = ["--secret-file", str(secret), "--run-id", RUN_ID] if secret is not None else []
    timeouts = [] if defaults else ["--timeout-s", "30", "--heartbeat-timeout-s", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm.cli", "lighthouse", "--port", str(port), *timeouts,
         *keyed],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert "lighthouse at" in (proc.stdout.readline() if proc.stdout else "")
    return proc


def stranger(port: int, name: str, data: dict, stop: threading.Event, threads: int) -> None:
    """Quorum requests under ``name`` from ``threads`` threads until ``stop`` (once if 0)."""
    from lowcomm.lab.bench.stranger import flood

    flood(f"127.0.0.1:{port}", name, data, stop, threads)


def run_case(case: str, out: Path, secret: Path) -> dict:
    """One case: three sites, each by its own command, and the attack; what came of it."""
    from lowcomm.train.ports import free_port

    port = free_port(host="")
    killing = case in ("kill", "beats")
    lh = lighthouse(port, secret if FRONT else None, defaults=killing)
    stop = threading.Event()
    if case == "junk":  # once, before the sites start
        junk = {"site": 9, "tag": "start", "phase": "sync", "gen": 0, "join_from": 0,
                "enter": True, "run": RUN_ID, "fp": "x", "mac": "00" * 32}  # fmt: skip
        stranger(port, f"{RUN_ID}/site0009", junk, stop, threads=0)
    if case in ("flood", "swarm"):
        stranger(port, f"{RUN_ID}/site0001", {}, stop, threads=8 if case == "flood" else 400)
        threading.Timer(60.0, stop.set).start()
    t0 = time.time()
    procs = []
    for i in range(3):
        head = ["-c", LIAR] if case == "liar" and i == 2 else ["-m", "lowcomm.cli"]
        args = [*SITE, f"site={i}", f"lighthouse=127.0.0.1:{port}", f"secret_file={secret}",
                "--out", str(out / case / f"site{i}")]  # fmt: skip
        if killing:  # the finding's command: 300 steps, the lighthouse's heartbeat timeout
            args = [a for a in args if not a.startswith("heartbeat_timeout_s=")]
            args[args.index("--steps") + 1] = "300"
        procs.append(subprocess.Popen([sys.executable, *head, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    killed_at = None
    if killing:
        killed_at = kill_after(procs[2], out / case / "site2" / "metrics.jsonl", 50) - t0
        if case == "beats":
            threading.Thread(target=beat, args=(port, f"{RUN_ID}/site0002", stop),
                             daemon=True).start()  # fmt: skip
    said = [p.communicate(timeout=900) for p in procs]
    wall = time.time() - t0
    stop.set()
    lh.terminate()
    lh.communicate(timeout=30)
    row = summarize(case, out / case, [p.returncode for p in procs], said, wall)
    if killed_at is not None:
        row["killed_at_s"] = round(killed_at, 1)
        row["after_kill_s"] = round(wall - killed_at, 1)
    return row


def kill_after(proc: subprocess.Popen, metrics: Path, step: int) -> float:
    """SIGKILL ``proc`` once its metrics show ``step`` (its 5th sync at H = 10); when."""
    while proc.poll() is None:
        try:
            lines = metrics.read_text().splitlines()
            if any(json.loads(x).get("step", 0) >= step for x in lines if x.strip()):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.kill()
    return time.time()


def beat(port: int, name: str, stop: threading.Event) -> None:
    """A stranger's heartbeats under ``name`` every 0.2 s until ``stop``: torchft's own client."""
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    client = LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=timedelta(seconds=5))
    while not stop.is_set():
        try:
            client.heartbeat(name)
        except Exception:
            pass
        stop.wait(0.2)


def summarize(case: str, folder: Path, codes: list[int], said: list, wall: float) -> dict:
    """The row of one case."""
    finished = [
        i for i, c in enumerate(codes) if c == 0 and (folder / f"site{i}" / "model.pt").exists()
    ]
    losses, models = {}, []
    for i in finished:
        summary = json.loads((folder / f"site{i}" / "summary.json").read_text())
        losses[i] = summary["final_val_loss"]
        models.append(torch.load(folder / f"site{i}" / "model.pt", weights_only=True))
    equal = all(all(torch.equal(m[k], models[0][k]) for k in m) for m in models[1:])
    stopped = {i: err.strip().splitlines()[-1][:300] for i, (_, err) in enumerate(said)
               if codes[i] != 0 and err.strip()}  # fmt: skip
    return {"case": case, "codes": codes, "wall_s": round(wall, 1), "val_loss": losses,
            "models_equal": equal, "stopped": stopped}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    cases = sys.argv[2:] or ["clean", "flood", "junk", "liar"]
    out.mkdir(parents=True, exist_ok=True)
    secret = out / "secret"
    secret.write_text("the run's secret\n")
    os.environ.pop("LOWCOMM_SECRET", None)
    for case in cases:
        print(json.dumps(run_case(case, out, secret)), flush=True)


if __name__ == "__main__":
    main()
