"""``lowcomm bench chaos``: seeded random fault schedules against the membership protocol, each
run checked by invariants read from what every site recorded, not from the run's own verdict.

Each seed draws one schedule, reproducible from the seed alone: a method (DiLoCo, Streaming
with a fragment in flight, SparseLoCo, CO2) and a round mode (lock-step or quorum), stratified
over the seeds, and one to three overlapping faults from the ``--faults`` grammar (kill, a kill
with a later join, hang, pause, slow, an added site, a corrupt payload where payloads are
decoded; from a stream of their own, the lighthouse killed and restarted, and the healer of a
rejoining site killed inside its hand-over; from a third, a site's data plane cut for 20 or 60
s, and the lowest untouched site, the store host, killed or stopped inside a sync's
collectives), at most
``sites - min_workers`` of them taking a site away (killed, even if it joins later; hung;
paused, which may end it; excluded for its payload or cut off; a healer killed), so the run
never has fewer able sites than ``min_workers``. The run is ``lowcomm train ... elastic=true``
on this machine.

The checker, per run:

1. *No split*: every site logs a checksum of the global copy after each sync it applied
   (``DIR/sites/siteN.syncs.jsonl``); for every step, all sites that logged it agree.
2. *No needless stop*: while at least ``min_workers`` sites stay able (not killed for good,
   not hung), the run ends with exit 0 and a summary.
3. *Bounded*: the run ends within ``--limit`` seconds (else it is a hang, and is killed).
4. *Accounted*: the summary's ``tokens`` is at most what the sites' steps could have read.

Sizing on 2 cores: a schedule on ``tiny`` with 4 sites and 100 steps takes 25-45 s; run them
one at a time (parallel runs starve the heartbeats).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lowcomm import strategies

from .. import faults
from . import records
from . import stranger as strangers
from .stranger import KINDS as STRANGERS

TRAIN = [sys.executable, "-m", "lowcomm.lab", "train"]
METHODS = {
    "diloco": [],
    "streaming": ["fragments=2", "overlap=1"],
    "sparseloco": [],
    "co2": [],
}
ROUNDS = ("lockstep", "quorum")
KINDS = ("kill", "rejoin", "hang", "pause", "slow", "add", "corrupt")
FAULT_ORDER = faults.KINDS  # the report lists the kinds a pass drew in the grammar's order
MIN_WORKERS = 2
BATCH, SEQ = 4, 64
SECRET = "secret"  # the campaign's run secret, in its out folder
CAPTURED = "captured.jsonl"  # the sealed requests its strangers saw (replayed in later runs)


@dataclass
class Schedule:
    """One seed's run: what to train, how rounds close, and the faults."""

    seed: int
    method: str
    rounds: str
    sites: int
    steps: int
    faults: list[str] = field(default_factory=list)
    lost: int = 0  # sites away at some point (killed, hung, paused): at most sites - min_workers
    # the adversary beside the faults: an insider (a fault of the grammar: liar, dissent,
    # accuse) or a stranger (kind, site, delay_s, seconds: see .stranger); "" for none
    adversary: str = ""
    stranger: dict[str, Any] | None = None
    keyed: bool = False  # with the campaign's secret (a campaign that draws adversaries)

    def command(self, out: Path) -> list[str]:
        """The ``lowcomm train`` command that runs this schedule into ``out`` (``keyed``: with
        the campaign's secret, ``out``'s parent's ``secret``)."""
        args = [
            *TRAIN,
            "--strategy",
            self.method,
            "--workers",
            str(self.sites),
            "--model",
            "tiny",
            "--steps",
            str(self.steps),
            "--out",
            str(out),
            "sync_every=10",
            f"batch_size={BATCH}",
            f"seq_len={SEQ}",
            "eval_every=0",
            "progress=false",
            "elastic=true",
            f"min_workers={MIN_WORKERS}",
            "heartbeat_timeout_s=1",
            "timeout_s=10",
            f"rounds={self.rounds}",
            f"seed={self.seed}",
            *([f"secret_file={out.parent / SECRET}"] if self.keyed else []),
            *METHODS[self.method],
        ]
        if any(f.startswith("liar:") for f in self.faults):  # its lie shows at a check
            args.append("replica_check_every=2")
        if self.faults:
            args += ["--faults", ",".join(self.faults)]
        return args


def draw(
    seed: int,
    methods: list[str],
    rounds: list[str],
    sites: int,
    steps: int,
    adversaries: tuple[str, ...] = (),
) -> Schedule:
    """The schedule of ``seed``: method and round mode stratified, faults at random, and one
    adversary if its drawn kind is among ``adversaries`` (none: no adversary)."""
    rng = random.Random(seed)
    method = methods[seed % len(methods)]
    mode = rounds[(seed // len(methods)) % len(rounds)]
    sched = Schedule(seed, method, mode, sites, steps, keyed=bool(adversaries))
    spare = sites - MIN_WORKERS  # how many sites may go for good
    busy: set[int] = set()
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(KINDS)
        if kind == "corrupt" and not _decoded(method):
            kind = "kill"  # an all-reduce sums numbers: nothing to refuse
        free = [s for s in range(1, sites) if s not in busy]  # site 0 too, now and then
        if rng.random() < 0.25 and 0 not in busy:
            free = [0]
        if not free:
            break
        site, at = rng.choice(free), rng.randint(15, steps - 25)
        # a site killed (even if it joins later), hung or paused (back, it may only stop) is
        # not able while it is away: never fewer able sites than min_workers at any moment
        if kind in ("kill", "rejoin", "hang", "pause", "corrupt"):
            if sched.lost >= spare:
                kind = "slow"
            else:
                sched.lost += 1
        busy.add(site)
        if kind == "kill":
            sched.faults.append(f"kill:{site}@{at}")
        elif kind == "rejoin":
            back = min(at + rng.randint(5, 30), steps - 5)
            sched.faults += [f"kill:{site}@{at}", f"join:{site}@{back}"]
        elif kind == "hang":
            sched.faults.append(f"hang:{site}@{at}")
        elif kind == "pause":
            sched.faults.append(f"pause:{site}@{at}x{rng.choice([2, 4, 8])}")
        elif kind == "corrupt":  # its sender is excluded: away for good
            sched.faults.append(f"corrupt:{site}@{at}")
        elif kind == "slow":
            sched.faults.append(f"slow:{site}@{at}x{rng.choice([2, 3])}")
        elif not any(f.startswith("add:") for f in sched.faults):
            sched.faults.append(f"add:{sites}@{at}")
    _draw_more(sched, random.Random(seed * 7919 + 1), busy, adversaries)
    return sched


def _decoded(method: str) -> bool:
    """Whether ``method``'s payloads are decoded by their receivers (a corrupt: fault applies;
    the launcher refuses it where a run all-reduces: the same rule, asked of the preset)."""
    strategy = strategies.get(method)
    return not strategy.per_step and strategy.config().resolved_reduce != "allreduce"


def _draw_more(
    sched: Schedule, rng: random.Random, busy: set[int], adversaries: tuple[str, ...]
) -> None:
    """Faults of the kinds added later, from a stream of their own (the earlier kinds' draws,
    and the campaigns run on them, stay as they were): the lighthouse killed and started
    again, and the healer of a rejoining site killed inside the hand-over."""
    lighthouse = None
    if rng.random() < 0.3:
        lighthouse = (rng.randint(15, sched.steps - 25), rng.choice([1, 3]), rng.random())
    joins = [f for f in sched.faults if f.startswith("join:")]
    healers = [s for s in range(sched.sites) if s not in busy]
    if joins and healers and sched.lost < sched.sites - MIN_WORKERS and rng.random() < 0.5:
        back = int(joins[0].split("@")[1])
        sched.faults.append(f"healer:{healers[0]}@{max(1, back - 5)}")  # the lowest old member
        sched.lost += 1
        busy.add(healers[0])
    _draw_network(sched, random.Random(sched.seed * 7919 + 2), busy)
    _draw_adversary(sched, random.Random(sched.seed * 7919 + 3), busy, adversaries)
    if lighthouse is not None:  # asked by a site no fault takes away (drawn last: it knows)
        at, seconds, pick = lighthouse
        there = [s for s in range(sched.sites) if not _away(sched, s)]
        sched.faults.append(f"lighthouse:{there[int(pick * len(there))]}@{at}x{seconds}")


def _away(sched: Schedule, site: int) -> bool:
    """Whether a fault of ``sched`` takes ``site`` away at some point."""
    return any(f.split("@")[0] in (f"{k}:{site}" for k in _AWAY) for f in sched.faults)


_AWAY = (
    "kill",
    "hang",
    "pause",
    "corrupt",
    "healer",
    "collective",
    "stall",
    "link",
    *faults.INSIDERS,
)
ADVERSARIES = (*faults.INSIDERS, *STRANGERS)


def _draw_adversary(
    sched: Schedule, rng: random.Random, busy: set[int], allowed: tuple[str, ...]
) -> None:
    """From a fourth stream: one adversary. An insider (a site that lies in its votes or its
    checksum: the others exclude it, so it takes a site away, within the same budget; else a
    stranger instead), or a stranger at the lighthouse, who takes nobody away: a flooded site
    must not stop. Not a stranger where sites sit in namespaces (a ``link:`` fault): it would
    not reach their lighthouse."""
    kind = rng.choice(ADVERSARIES)
    free = [s for s in range(sched.sites) if s not in busy]
    netns = any(f.startswith("link:") for f in sched.faults)
    if kind in faults.INSIDERS and (not free or sched.lost >= sched.sites - MIN_WORKERS):
        kind = rng.choice(STRANGERS)
    if kind not in allowed:  # (the stream drew it all the same: the rest stay as they are)
        return
    if kind in faults.INSIDERS:
        site, at = rng.choice(free), rng.randint(15, sched.steps - 25)
        sched.faults.append(f"{kind}:{site}@{at}")
        sched.adversary = f"{kind}:{site}@{at}"
        sched.lost += 1
        busy.add(site)
    elif not netns:
        site = rng.randrange(sched.sites)
        delay = 0.0 if kind == "junk" else round(rng.uniform(0.5, 4.0), 1)
        seconds = rng.choice([20.0, 40.0])
        if kind == "beat":  # under a dead site's name where one dies, for the rest of the run
            site = _victim(sched.faults, rng) if rng.random() < 0.7 else site
            seconds = 300.0
        sched.stranger = {"kind": kind, "site": site, "delay_s": delay, "seconds": seconds}
        sched.adversary = f"{kind}:{site}+{delay:g}s x{seconds:g}s"


def _victim(faults_: list[str], rng: random.Random) -> int:
    """A site a schedule's fault kills, hangs or pauses (``KIND:SITE@STEP``), else site 0."""
    hit = []
    for f in faults_:
        kind, _, rest = f.partition(":")
        site = rest.split("@")[0]
        if kind in ("kill", "rejoin", "hang", "pause") and site.isdigit():
            hit.append(int(site))
    return rng.choice(hit) if hit else 0


def _draw_network(sched: Schedule, rng: random.Random, busy: set[int]) -> None:
    """From a third stream: a site cut off on the data plane (tc in its own namespace), and
    the lowest untouched site (the store host of every group while site 0 is in) killed or
    stopped inside a sync's collectives. Each takes a site away, within the same budget."""
    spare = sched.sites - MIN_WORKERS
    free = [s for s in range(sched.sites) if s not in busy]
    if free and sched.lost < spare and rng.random() < 0.4:
        site = rng.choice(free)
        at = rng.randint(15, sched.steps - 25)
        sched.faults.append(f"link:{site}@{at}x{rng.choice([20, 60])}")
        sched.lost += 1
        busy.add(site)
        free.remove(site)
    if free and sched.lost < spare and rng.random() < 0.4:
        at = rng.randint(15, sched.steps - 25)
        kind = rng.choice(["collective", "stall"])  # dies, or stops, inside a sync
        sched.faults.append(f"{kind}:{free[0]}@{at}")
        sched.lost += 1
        busy.add(free[0])


def check(sched: Schedule, out: Path, code: int | None, wall_s: float, limit: float) -> list[str]:
    """The invariants this run broke (empty: none), read from the sites' own records."""
    broken = []
    if code is None:
        broken.append(f"bounded: still running after {limit:g} s (killed)")
    elif code != 0 and sched.sites - sched.lost >= MIN_WORKERS:
        broken.append(f"no needless stop: exit {code} with {sched.sites - sched.lost} able sites")
    split = records.split(out)
    if split:
        broken.append(f"no split: {split}")
    summary = out / "summary.json"
    if code == 0 and not summary.exists():
        broken.append("no needless stop: exit 0 without a summary")
    if summary.exists():
        tokens = int(json.loads(summary.read_text()).get("tokens", 0))
        most = (sched.sites + 1) * sched.steps * BATCH * SEQ
        if not 0 < tokens <= most:
            broken.append(f"accounted: tokens {tokens} outside (0, {most}]")
    return broken


def run_one(sched: Schedule, out: Path, limit: float) -> dict[str, Any]:
    """Run one schedule and check it; its row."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    stranger = None
    t0 = time.monotonic()
    try:
        if sched.stranger is not None:  # it waits for the run's file, then acts
            stranger = strangers.spawn(sched.stranger, out, out.parent / CAPTURED)
        code = _run(sched, out, limit)
    finally:
        acted = strangers.collect(stranger) if stranger is not None else None
    wall = time.monotonic() - t0
    strangers.heard(acted, out.parent / CAPTURED, out.parent / SECRET, sched.sites)
    broken = check(sched, out, code, wall, limit)
    summary = json.loads((out / "summary.json").read_text()) if code == 0 else {}
    events = summary.get("membership") or []
    return {
        **asdict(sched),
        "exit": code,
        "wall_s": round(wall, 1),
        "loss": summary.get("final_val_loss"),
        "goodput": summary.get("goodput"),
        "resync_s": [e["resync_s"] for e in events if e.get("left") and "resync_s" in e],
        "heal_s": [e["heal_s"] for e in events if "heal_s" in e],
        "stranger_acted": acted,
        "violations": broken,
    }


def _run(sched: Schedule, out: Path, limit: float) -> int | None:
    """The schedule's run, its output in ``out``'s log; its exit code (None: killed at
    ``limit``, a hang)."""
    with open(out.parent / f"{out.name}.log", "w") as log:
        # a session of its own: a hung run's sites (the launcher's forkserver children) end too
        proc = subprocess.Popen(
            sched.command(out), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a stopped (hung) site left behind too
        proc.wait()
    return code


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",") if s]


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowcomm bench chaos", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0-39", help="A-B or a comma list")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", default=",".join(ROUNDS))
    p.add_argument("--sites", type=int, default=None, help="4 (3 with --ranks above 1)")
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="above 1: sites of this many ranks, each its own torchrun, faults done "
        "from outside (see lowcomm.lab.bench.chaos_sites)",
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--limit", type=float, default=240.0, help="seconds before a run is a hang")
    p.add_argument("--out", default="runs/bench-chaos")
    p.add_argument(
        "--adversaries",
        default=",".join(ADVERSARIES),
        help="the kinds of adversary a schedule may draw (none: no adversary)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the schedules, run nothing")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also a run without faults per method and round mode",
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run every seed's schedule one at a time; a line per run; exit 1 on any violation."""
    a = _args(argv)
    methods, rounds = a.methods.split(","), a.rounds.split(",")
    if a.ranks > 1:  # sites as deployed: lock-step (quorum rounds are one rank per site)
        from . import chaos_sites

        return chaos_sites.main(
            _seeds(a.seeds),
            methods,
            a.sites or 3,
            a.ranks,
            a.steps,
            a.limit,
            Path(a.out),
            a.dry_run,
            tuple(k for k in a.adversaries.split(",") if k in chaos_sites.ADVERSARIES),
        )
    a.sites = a.sites or 4
    adversaries = tuple(k for k in a.adversaries.split(",") if k and k != "none")
    unknown = sorted(set(methods) - set(METHODS)) + sorted(set(rounds) - set(ROUNDS))
    unknown += sorted(set(adversaries) - set(ADVERSARIES))
    if unknown:
        raise SystemExit(
            f"lowcomm bench chaos: unknown {unknown}: use {list(METHODS)}, {ROUNDS}, {ADVERSARIES}"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if adversaries and not (out / SECRET).exists():  # one secret: runs told apart by run id
        (out / SECRET).write_text(os.urandom(16).hex() + "\n")
    cut = [
        s
        for s in _seeds(a.seeds)
        if any(f.startswith("link:") for f in draw(s, methods, rounds, a.sites, a.steps).faults)
    ]
    if cut and not a.dry_run and (os.geteuid() != 0 or shutil.which("tc") is None):
        raise SystemExit(
            f"lowcomm bench chaos: seeds {cut[:5]}... cut a site's link (tc in "
            f"namespaces): run as root with iproute2, or leave them out"
        )
    rows = []
    for seed in _seeds(a.seeds):
        sched = draw(seed, methods, rounds, a.sites, a.steps, adversaries)
        if a.dry_run:
            print(json.dumps(asdict(sched)))
            continue
        row = run_one(sched, out / f"seed{seed}", a.limit)
        rows.append(row)
        verdict = "ok" if not row["violations"] else "; ".join(row["violations"])
        print(
            f"seed {seed} {sched.method} {sched.rounds} {','.join(sched.faults)} "
            f"[{sched.adversary or 'no adversary'}]: exit "
            f"{row['exit']} in {row['wall_s']} s: {verdict}",
            flush=True,
        )
        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["violations"]]
    if a.baseline and not a.dry_run:
        rows += _baselines(methods, rounds, a, out)
        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    if rows:
        print(summarize(rows))
        (out / "summary.md").write_text(summarize(rows) + "\n")
    return 1 if bad else 0


def _baselines(
    methods: list[str], rounds: list[str], a: argparse.Namespace, out: Path
) -> list[dict[str, Any]]:
    """One run without faults per method and round mode (seed 0): the goodput the campaign's
    runs are compared with."""
    rows = []
    for method in methods:
        for mode in rounds:
            sched = Schedule(0, method, mode, a.sites, a.steps)
            row = run_one(sched, out / f"baseline-{method}-{mode}", a.limit)
            rows.append({**row, "baseline": True})
            print(f"baseline {method} {mode}: goodput {row['goodput']}", flush=True)
    return rows


def _median_p95(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{xs[len(xs) // 2]:g} / {xs[min(len(xs) - 1, int(0.95 * len(xs)))]:g}"


def summarize(rows: list[dict[str, Any]]) -> str:
    """Markdown: schedules and violations by method and round mode (with goodput against
    the baseline run, where there is one), by fault kind, and resync and heal times."""
    base = {(x["method"], x["rounds"]): x["goodput"] for x in rows if x.get("baseline")}
    rows = [x for x in rows if not x.get("baseline")]
    lines = [
        "| method | rounds | schedules | violations | median wall s | goodput: median of "
        "finished runs / without faults |",
        "|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        for r in ROUNDS:
            sel = [x for x in rows if x["method"] == m and x["rounds"] == r]
            if sel:
                walls = sorted(x["wall_s"] for x in sel)
                bad = sum(bool(x["violations"]) for x in sel)
                good = sorted(x["goodput"] for x in sel if x.get("goodput"))
                ratio = "-"
                if good and base.get((m, r)):
                    ratio = f"{good[len(good) // 2]:,.0f} / {base[(m, r)]:,.0f} tok/s"
                lines.append(
                    f"| {m} | {r} | {len(sel)} | {bad} | {walls[len(walls) // 2]} | {ratio} |"
                )
    resync = [t for x in rows for t in x.get("resync_s", [])]
    heals = [t for x in rows for t in x.get("heal_s", [])]
    lines += [
        "",
        f"Resync after a site left (s, median / p95 of {len(resync)}): "
        f"{_median_p95(resync)}; heal (s, median / p95 of {len(heals)}): "
        f"{_median_p95(heals)}",
    ]
    lines += ["", "| fault kind | schedules with it | violations |", "|---|---|---|"]
    drawn = {f.split(":")[0] for x in rows for f in x["faults"]}
    for kind in sorted(drawn, key=lambda k: (FAULT_ORDER.index(k) if k in FAULT_ORDER else 99, k)):
        sel = [x for x in rows if any(f.startswith(kind + ":") for f in x["faults"])]
        bad = sum(bool(x["violations"]) for x in sel)
        lines.append(f"| {kind} | {len(sel)} | {bad} |")
    lines += ["", "| adversary | schedules with it | violations |", "|---|---|---|"]
    for kind in (*ADVERSARIES, ""):
        sel = [x for x in rows if (x.get("adversary") or "").split(":")[0] == kind]
        if sel:
            bad = sum(bool(x["violations"]) for x in sel)
            lines.append(f"| {kind or 'none'} | {len(sel)} | {bad} |")
    bad = [x for x in rows if x["violations"]]
    lines += ["", f"{len(rows)} schedules, {len(bad)} with violations"]
    lines += [
        f"- seed {x['seed']} ({x['method']}, {x['rounds']}, {','.join(x['faults'])}, "
        f"{x.get('adversary') or 'no adversary'}): "
        f"{'; '.join(x['violations'])}"
        for x in bad
    ]
    return "\n".join(lines)
