"""A per-site deployment that loses a machine, with a stranger under a member's name, from
outside (the trust issue's second finding): three sites of 2 ranks, each its own `torchrun
--standalone --nproc-per-node 2 -m lowcomm.cli train --strategy sparseloco --model tiny
--steps 300 sync_every=10 elastic=true sites=3 site=N secret_file=F lighthouse=HOST:P`, each
in a network namespace of its own behind a 50 Mbit/s `tbf` uplink, `lowcomm lighthouse`
standalone on the bridge. Then:

1. after site 0's third sync its torchrun and both ranks are SIGKILLed (a lost machine; each
   rank runs in a session of its own, so a kill of torchrun's process group would leave them);
2. its unchanged command is run again 5 s later;
3. three syncs later a process without the secret starts as `site=1` from a fourth namespace,
   with the same command otherwise.

Cases: `keyed` (the lighthouse given the secret and the run id: what a keyed run must use) and
`open` (no secret on the lighthouse: each keyed site must refuse it, in one line, before it
trains). One JSON row per run: exit codes, wall seconds, whether the three models are equal,
each site's last line where it stopped, and what the stranger said.

    python benchmarks/relaunch_from_outside.py OUT_DIR [keyed|open] [RUNS]

Needs root (network namespaces) and torchft.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from lowcomm.lab.bench.deployed import Deployment
from lowcomm.lab.netshape.network import ShapedNetwork

RUN_ID = "relaunch"


def train(secret: Path | None):
    """Each site's `lowcomm train` arguments (``secret`` None: the stranger's)."""

    def args(site: int, lighthouse: str) -> list[str]:
        keyed = [f"secret_file={secret}"] if secret is not None else []
        return ["train", "--strategy", "sparseloco", "--model", "tiny", "--steps", "300",
                "sync_every=10", "elastic=true", "sites=3", f"site={site}", f"run_id={RUN_ID}",
                "progress=false", f"lighthouse={lighthouse}", *keyed]  # fmt: skip

    return args


def wait_for(cond, timeout_s: float = 600.0) -> None:
    """Until ``cond()`` (polled every 0.1 s)."""
    until = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > until:
            raise TimeoutError("gave up waiting")
        time.sleep(0.1)


def one_run(out: Path, net: ShapedNetwork, secret: Path, keyed: bool) -> dict:
    """One run of the scenario; its row."""
    dep = Deployment(out, 2, train(secret), net, timeout_s=30.0,
                     secret_file=str(secret) if keyed else "")  # fmt: skip
    # the deployment's commands run `-m lowcomm.lab`; a user's, `-m lowcomm.cli`
    dep.command = _as_cli(dep.command)  # type: ignore[method-assign]
    t0 = time.monotonic()
    stranger = None
    try:
        for site in range(3):
            dep.start(site)
        if not keyed:  # every keyed site must refuse the open lighthouse, before it trains
            codes = [dep.procs[s].wait(timeout=300) for s in range(3)]
            return _row(dep, codes, time.monotonic() - t0, None)
        wait_for(lambda: dep.syncs(0) >= 3 or dep.procs[0].poll() is not None)
        dep.lose(0)  # a lost machine: torchrun and both ranks (each in a session of its own)
        time.sleep(5.0)
        dep.start(0)  # the same command again
        at = dep.syncs(1)
        wait_for(lambda: dep.syncs(1) >= at + 3 or dep.procs[1].poll() is not None)
        argv = dep.command(3)  # the fourth namespace, site 1's command without the secret
        argv = [a for a in argv if not a.startswith("secret_file=")]
        argv[argv.index("site=3")] = "site=1"
        argv[argv.index("--out") + 1] = str(out / "stranger")
        env = {k: v for k, v in os.environ.items() if k != "LOWCOMM_SECRET"}
        log = open(out / "stranger.log", "w")  # noqa: SIM115 (closed below)
        stranger = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
        codes = [dep.procs[s].wait(timeout=900) for s in range(3)]
        wall = time.monotonic() - t0
        return _row(dep, codes, wall, stranger)
    finally:
        if stranger is not None:
            if stranger.poll() is None:
                os.killpg(stranger.pid, signal.SIGKILL)
            stranger.wait()
        dep.close()


def _as_cli(command):
    def run(site: int) -> list[str]:
        argv = command(site)
        i = argv.index("lowcomm.lab")
        return [*argv[:i], "lowcomm.cli", *argv[i + 1 :]]

    return run


def _row(dep: Deployment, codes: list[int], wall: float, stranger) -> dict:
    models = []
    for s in range(3):
        path = dep.out(s) / "model.pt"
        models.append(torch.load(path, weights_only=True) if path.exists() else None)
    done = [m for m in models if m is not None]
    equal = len(done) == 3 and all(all(torch.equal(m[k], done[0][k]) for k in m) for m in done)
    last = {}
    for s in range(3):
        lines = dep.log(s).strip().splitlines()
        errors = [x for x in lines if x.startswith("error:")]
        if codes[s] != 0 or errors:  # a start that stopped with its line, or the last one
            last[s] = (errors[-1] if errors else lines[-1] if lines else "")[:300]
    said = ""
    if stranger is not None:
        lines = (dep.root / "stranger.log").read_text().strip().splitlines()
        errors = [x for x in lines if x.startswith("error:")]  # its ranks' one line
        said = (errors[-1] if errors else lines[-1] if lines else "")[:300]
    code = None if stranger is None else stranger.poll()
    return {"codes": codes, "wall_s": round(wall, 1), "models_equal": equal,
            "started": dep.started, "stopped": last,
            "stranger": {"code": code, "said": said}}  # fmt: skip


def main() -> None:
    out = Path(sys.argv[1])
    case = sys.argv[2] if len(sys.argv) > 2 else "keyed"
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    out.mkdir(parents=True, exist_ok=True)
    secret = out / "secret"
    secret.write_text("the run's secret\n")
    with ShapedNetwork("50mbit", topology="per-worker", workers=4, name_prefix="lcrel") as net:
        for r in range(runs):
            row = one_run(out / f"{case}{r}", net, secret, case == "keyed")
            print(json.dumps({"case": case, "run": r, **row}), flush=True)


if __name__ == "__main__":
    main()
