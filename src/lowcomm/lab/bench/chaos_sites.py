"""``lowcomm bench chaos --ranks R``: fault schedules against sites as they are deployed: a
standalone lighthouse and one ``torchrun --nproc-per-node R ... site=N`` per site (FSDP2 inside
each), every fault done to them from outside, as an operator or a failing machine would:

- ``kill``: SIGKILL of one rank of a site (torchrun takes the rest of the site down with it);
- ``rejoin``: the same, then the site's same command again once its torchrun has exited;
- ``pause``: SIGSTOP of one rank for 2, 8 or 30 s, then SIGCONT (the site goes on, or leaves);
- ``lose``: a lost machine: SIGKILL of the site's torchrun and every rank (each its own session),
  its same command again 5 s later (a stranger drawn beside it most often takes its name);
- ``lighthouse``: the lighthouse killed and started again at its address 1 or 3 s later.

At most ``sites - min_workers`` faults take a site away; the rank hit (0, the member, or
another) is drawn too. Faults fire when the site has logged that many syncs. The checker reads
what each site recorded in its own folder, as :mod:`.chaos` does, and also:

- *Same end*: every site that finished wrote the same ``model.pt``;
- a restarted site either finishes or says the run it asked for was over (no violation).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import records
from . import stranger as strangers
from .deployed import Deployment

METHODS = {"diloco": [], "streaming": ["fragments=2", "overlap=1"], "sparseloco": [], "co2": []}
KINDS = ("kill", "rejoin", "pause", "lose")  # lose: the machine (its torchrun and every rank)
LOST_S = 5.0  # a lost machine's command runs again this long after
MIN_WORKERS = 2
BATCH, SEQ, EVERY = 4, 64, 10
OVER = (
    "no run is going",
    "found no run to join",
    "no other site has been in the run",
    "it ended before this site was let back in",
)
# an insider here lies in its votes (a false checksum stops sites of several ranks on purpose:
# their replica check is no vote, docs/reliability.md); or a stranger at the lighthouse
INSIDERS = ("dissent", "accuse", "ender")
ADVERSARIES = (*INSIDERS, *strangers.KINDS)
SECRET, CAPTURED = "secret", "captured.jsonl"  # in the campaign's folder


@dataclass
class SitesSchedule:
    """One seed's deployed run: the method, the shape, and the faults done from outside."""

    seed: int
    method: str
    sites: int
    ranks: int
    steps: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    lost: int = 0  # sites taken away at some point (at most sites - MIN_WORKERS)
    adversary: str = ""  # an insider's fault (KIND:SITE@STEP) or a stranger's line; "": none
    insider: str = ""  # the insider's --faults, given to its site alone
    insider_site: int = -1
    stranger: dict[str, Any] | None = None
    secret: str = ""  # the campaign's secret file ("" for none)

    def train(self, site: int, lighthouse: str) -> list[str]:
        """Site ``site``'s ``lowcomm train`` arguments (the same to bring it back)."""
        keyed = [f"secret_file={self.secret}"] if self.secret else []
        lies = ["--faults", self.insider] if self.insider_site == site else []
        return [
            "train",
            "--strategy",
            self.method,
            "--model",
            "tiny",
            "--steps",
            str(self.steps),
            f"sync_every={EVERY}",
            f"batch_size={BATCH}",
            f"seq_len={SEQ}",
            "eval_every=0",
            "progress=false",
            "elastic=true",
            f"min_workers={MIN_WORKERS}",
            "heartbeat_timeout_s=1",
            "timeout_s=10",
            f"seed={self.seed}",
            f"site={site}",
            f"sites={self.sites}",
            f"lighthouse={lighthouse}",
            *keyed,
            *METHODS[self.method],
            *lies,
        ]


def draw(
    seed: int,
    methods: list[str],
    sites: int,
    ranks: int,
    steps: int,
    adversaries: tuple[str, ...] = (),
) -> SitesSchedule:
    """The schedule of ``seed``: the method stratified; one to two faults at random; one
    adversary if its drawn kind is among ``adversaries``."""
    rng = random.Random(seed)
    sched = SitesSchedule(seed, methods[seed % len(methods)], sites, ranks, steps)
    syncs = steps // EVERY
    busy: set[int] = set()
    for _ in range(rng.randint(1, 2)):
        free = [s for s in range(sites) if s not in busy]
        if sched.lost >= sites - MIN_WORKERS or not free:
            break
        kind, site = rng.choice(KINDS), rng.choice(free)
        fault = {
            "kind": kind,
            "site": site,
            "rank": rng.randrange(ranks),
            "sync": rng.randint(2, max(2, syncs // 2)),
        }
        if kind == "pause":
            fault["seconds"] = rng.choice([2, 8, 30])
        sched.faults.append(fault)
        sched.lost += 1
        busy.add(site)
    if rng.random() < 0.3:
        sched.faults.append(
            {"kind": "lighthouse", "sync": rng.randint(2, syncs - 3), "seconds": rng.choice([1, 3])}
        )
    _draw_adversary(sched, random.Random(seed * 7919 + 3), busy, adversaries)
    return sched


def _draw_adversary(
    sched: SitesSchedule, rng: random.Random, busy: set[int], allowed: tuple[str, ...]
) -> None:
    """From a stream of its own: one adversary, as in :mod:`.chaos` (an insider takes a site
    away within the same budget, else a stranger comes instead)."""
    kind = rng.choice(ADVERSARIES)
    free = [s for s in range(sched.sites) if s not in busy]
    if kind in INSIDERS and (not free or sched.lost >= sched.sites - MIN_WORKERS):
        kind = rng.choice(strangers.KINDS)
    if kind not in allowed:
        return
    if kind in INSIDERS:
        site, at = rng.choice(free), rng.randint(15, sched.steps - 25)
        sched.insider, sched.insider_site = f"{kind}:{site}@{at}", site
        sched.adversary = sched.insider
        sched.lost += 1
        busy.add(site)
        return
    site = rng.randrange(sched.sites)
    delay = 0.0 if kind == "junk" else round(rng.uniform(0.5, 4.0), 1)
    seconds = rng.choice([20.0, 40.0])
    lost = [f["site"] for f in sched.faults if f["kind"] in KINDS]
    if kind in ("beat", "flood") and lost and rng.random() < 0.7:
        # under the name of the site a machine loss (and its relaunch) takes: both at once
        site, seconds = rng.choice(lost), 300.0 if kind == "beat" else seconds
    sched.stranger = {"kind": kind, "site": site, "delay_s": delay, "seconds": seconds}
    sched.adversary = f"{kind}:{site}+{delay:g}s x{seconds:g}s"


class Faults:
    """The faults of one schedule done to a :class:`~.deployed.Deployment`, and their
    follow-ups (a SIGCONT, the lighthouse back, a site's command again)."""

    def __init__(self, run: Deployment) -> None:
        self.run = run
        self.later: list[tuple[float, str, Any]] = []  # (when, what, with what)

    def fire(self, fault: dict[str, Any]) -> None:
        """Do ``fault`` now (its follow-ups are queued)."""
        now, run = time.monotonic(), self.run
        if fault["kind"] == "lighthouse":
            run.lighthouse.kill()
            run.lighthouse.wait()
            self.later.append((now + fault["seconds"], "lighthouse", None))
            return
        if fault["kind"] == "lose":  # the machine: torchrun and every rank, then its command
            run.lose(fault["site"])
            self.later.append((now + LOST_S, "restart", fault["site"]))
            return
        pid = run.rank_pid(fault["site"], fault["rank"])
        if pid is None:
            return
        if fault["kind"] == "pause":
            os.kill(pid, signal.SIGSTOP)
            self.later.append((now + fault["seconds"], "cont", pid))
        else:
            os.kill(pid, signal.SIGKILL)
            if fault["kind"] == "rejoin":
                self.later.append((now, "restart", fault["site"]))

    def follow_up(self) -> None:
        """The queued follow-ups that are due (a restart once the site's torchrun exited)."""
        now, keep, run = time.monotonic(), [], self.run
        for when, what, arg in self.later:
            if when > now:
                keep.append((when, what, arg))
            elif what == "cont":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(arg, signal.SIGCONT)
            elif what == "lighthouse":
                run.start_lighthouse()
            elif run.procs[arg].poll() is None:
                keep.append((when, what, arg))  # its torchrun is still taking it down
            else:
                run.start(arg)
        self.later = keep


def run_one(sched: SitesSchedule, out: Path, limit: float) -> dict[str, Any]:
    """Run one deployed schedule and check it; its row."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()
    run = Deployment(out, sched.ranks, sched.train, secret_file=sched.secret)
    faults = Faults(run)
    stranger = None
    try:
        if sched.stranger is not None:  # it waits for site 0's run id, then acts
            stranger = strangers.spawn(sched.stranger, out, out.parent / CAPTURED, run.address)
        for s in range(sched.sites):
            run.start(s)
        pending = sorted(sched.faults, key=lambda f: f["sync"])
        while time.monotonic() - t0 < limit:
            for f in list(pending):
                site = f.get("site", 0)
                if max(run.syncs(s) for s in range(sched.sites)) >= f["sync"] and (
                    f["kind"] == "lighthouse" or run.syncs(site) >= f["sync"]
                ):
                    faults.fire(f)
                    pending.remove(f)
            faults.follow_up()
            if not faults.later and all(p.poll() is not None for p in run.procs.values()):
                break
            time.sleep(0.1)
        codes = {s: p.poll() for s, p in run.procs.items()}
    finally:
        run.close()
        acted = strangers.collect(stranger) if stranger is not None else None
        strangers.heard(acted, out.parent / CAPTURED, sched.secret or "", sched.sites)
    wall = time.monotonic() - t0
    broken = check(sched, out, codes, limit)
    return {
        **asdict(sched),
        "exit": codes,
        "wall_s": round(wall, 1),
        "stranger_acted": acted,
        "violations": broken,
    }


def check(sched: SitesSchedule, out: Path, codes: dict[int, int | None], limit: float) -> list:
    """The invariants this deployed run broke (empty: none), from the sites' own folders."""
    broken = []
    hit = {f["site"] for f in sched.faults if f["kind"] != "lighthouse"}
    hit |= {sched.insider_site} if sched.insider else set()  # excluded: it stops alone
    for s, code in codes.items():
        log = "\n".join(p.read_text() for p in sorted(out.glob(f"site{s}.*.log")))
        if code is None:
            broken.append(f"bounded: site {s} still running after {limit:g} s (killed)")
        elif code != 0 and s not in hit:
            broken.append(f"no needless stop: site {s} (no fault) exit {code}")
        elif code != 0 and _again(sched, s) and not any(w in log for w in OVER):
            broken.append(f"no needless stop: site {s} came back and exit {code}")
        elif code == 0 and not (out / f"site{s}" / "summary.json").exists():
            broken.append(f"no needless stop: site {s} exit 0 without a summary")
    merged = out / "all"
    (merged / "sites").mkdir(parents=True, exist_ok=True)
    for s in range(sched.sites):
        for f in (out / f"site{s}" / "sites").glob("site*.syncs.jsonl"):
            shutil.copy(f, merged / "sites" / f.name)
    split = records.split(merged)
    if split:
        broken.append(f"no split: {split}")
    ends = {
        s: records.model_digest(out / f"site{s}" / "model.pt") for s, c in codes.items() if c == 0
    }
    if len(set(ends.values())) > 1:
        broken.append(f"same end: the finished sites' models differ {ends}")
    most = (sched.steps * BATCH * SEQ) * sched.sites
    for s, c in codes.items():
        summary = out / f"site{s}" / "summary.json"
        if c == 0 and summary.exists():
            tokens = int(json.loads(summary.read_text()).get("tokens", 0))
            if not 0 < tokens <= most:
                broken.append(f"accounted: site {s} tokens {tokens} outside (0, {most}]")
    return broken


def _again(sched: SitesSchedule, site: int) -> bool:
    return any(f["kind"] in ("rejoin", "lose") and f["site"] == site for f in sched.faults)


def main(
    seeds: list[int],
    methods: list[str],
    sites: int,
    ranks: int,
    steps: int,
    limit: float,
    out: Path,
    dry_run: bool,
    adversaries: tuple[str, ...] = (),
) -> int:
    """Every seed's deployed schedule, one at a time; a line each; exit 1 on any violation.
    Keyed with one secret (DIR/secret) when adversaries may be drawn."""
    out.mkdir(parents=True, exist_ok=True)
    secret = out / SECRET
    if adversaries and not secret.exists():
        secret.write_text(os.urandom(16).hex() + "\n")
    rows = []
    for seed in seeds:
        sched = draw(seed, methods, sites, ranks, steps, adversaries)
        sched.secret = str(secret.resolve()) if adversaries else ""
        if dry_run:
            print(json.dumps(asdict(sched)))
            continue
        row = run_one(sched, out / f"seed{seed}", limit)
        rows.append(row)
        verdict = "ok" if not row["violations"] else "; ".join(row["violations"])
        said = ",".join(_fault(f) for f in sched.faults)
        print(
            f"seed {seed} {sched.method} {sites}x{ranks} {said} "
            f"[{sched.adversary or 'no adversary'}]: exit {row['exit']} in "
            f"{row['wall_s']} s: {verdict}",
            flush=True,
        )
        (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["violations"]]
    if rows:
        print(
            f"{len(rows)} deployed schedules ({sites} sites x {ranks} ranks), {len(bad)} with "
            f"violations"
        )
    return 1 if bad else 0


def _fault(f: dict[str, Any]) -> str:
    """A fault in one word: kind:site.rank@sync(xseconds)."""
    where = f"{f['site']}.{f['rank']}" if "site" in f else "-"
    return f"{f['kind']}:{where}@{f['sync']}" + (f"x{f['seconds']}" if "seconds" in f else "")
