"""Elastic runs of the reference trainer: one process per site, membership on a torchft
lighthouse (started here unless ``lighthouse=`` names one), and a dead site leaves the others
running (torch's launcher would tear every worker down with it).

Each site process has a torch.distributed world of its own (one rank); everything between
sites goes through the engine's membership: the outer syncs, and the trainer's few collectives
(loss logging, evaluation, the summary) on the live quorum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..config import ConfigError
from ..elastic.admission import read_secret
from ..errors import LowCommError
from .entry import clear_stale, error_file, failure_of, run_entry, user_errors
from .join_site import RUN_FILE, run_site, write_run_file
from .lighthouse import Keeper
from .site_role import ElasticSite
from .spec import RunSpec, check_fixed, check_membership, lighthouse_options
from .summary import written_since

# after one site finished the run, how long the launcher waits for the others to finish too
# (they end at the same sync, within a moment) before it stops those still behind
FINISH_GRACE_S = 30.0


class SitesFailed(LowCommError):
    """No site finished the run: the message says why (one line per distinct reason)."""

    def __init__(self, message: str, exitcode: int) -> None:
        super().__init__(message)
        self.exitcode = exitcode


class SiteNetwork(Protocol):
    """Where the sites of a run and its lighthouse run when they do not share this machine's
    loopback (an extension's: network namespaces bridged by shaped links, say)."""

    lighthouse_host: str  # the lighthouse's address there

    def site_setup(self, site: int, lighthouse: str) -> Callable[[], None]:
        """What site ``site``'s process runs before anything else (picklable)."""
        ...

    def lighthouse_setup(self) -> Callable[[], None]:
        """What the lighthouse's process runs before it serves (picklable)."""
        ...

    def close(self) -> None:
        """Take it down (the run is over)."""
        ...


@dataclass(frozen=True)
class SitePlan:
    """What the local launcher of an elastic run starts and sets up beyond one process per
    starting site: a replay's rejoins, or an extension's (a site killed and started again, a
    site added, a shaped network)."""

    # a site that leaves and joins again (started on standby, let in once the first is gone),
    # and how it is admitted: {"join_from": STEP} or {"join_at": TAG}
    again: dict[int, dict[str, Any]] = field(default_factory=dict)
    added: dict[int, dict[str, Any]] = field(default_factory=dict)  # new sites, numbered on
    pausing: frozenset[int] = frozenset()  # sites that stop and go on: still running
    network: SiteNetwork | None = None
    tick: Callable[[Keeper], None] | None = None  # every round of the launcher's wait
    close: Callable[[], None] | None = None  # once the run is over

    def merged(self, other: SitePlan | None) -> SitePlan:
        """This plan and ``other``'s together (one network at most)."""
        if other is None:
            return self
        if self.network is not None and other.network is not None:
            raise ConfigError("two extensions each put the sites in a network of their own")
        ticks = [t for t in (self.tick, other.tick) if t is not None]
        closes = [c for c in (self.close, other.close) if c is not None]
        return SitePlan(
            {**self.again, **other.again},
            {**self.added, **other.added},
            self.pausing | other.pausing,
            self.network or other.network,
            (lambda keeper: [t(keeper) for t in ticks]) if ticks else None,
            (lambda: [c() for c in closes]) if closes else None,
        )


def check_elastic(spec: RunSpec, workers: int) -> None:
    """One-line refusals of what the run's settings cannot do, before any site starts: its
    extensions' own, then an elastic run's (or a fixed world's)."""
    for ext in spec.extensions.values():
        ext.check(spec, workers)
    if not spec.elastic:
        check_fixed(spec)
        return
    check_membership(spec, workers, rejoin=False)  # (an extension's own rejoins: its check)
    if spec.membership.replay:
        replay_joins(spec.membership.replay, workers)  # read now: its errors before any start


def site_plan(spec: RunSpec, workers: int) -> SitePlan:
    """What the launcher of ``spec``'s sites starts beyond them: a replay's rejoins (sites
    added in the recorded run included), then each extension's plan."""
    m, plan = spec.membership, SitePlan()
    if m.replay:
        rejoins = replay_joins(m.replay, workers)
        when = {s: {"join_at": t} for s, t in rejoins.items()}
        plan = SitePlan(
            again={s: w for s, w in when.items() if s < workers},
            added={s: w for s, w in when.items() if s >= workers},
        )
    for ext in spec.extensions.values():
        plan = plan.merged(ext.plan(spec, workers))
    return plan


def replay_leaves(path: str, sites: int) -> dict[int, str]:
    """From a recorded membership.jsonl: each site that left, and the sync after which it did."""
    return _replayed(path, sites)[0]


def replay_joins(path: str, sites: int) -> dict[int, str]:
    """From a recorded membership.jsonl: each site that joined again, and the sync it joined at."""
    return _replayed(path, sites)[1]


def _replayed(path: str, sites: int) -> tuple[dict[int, str], dict[int, str]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"replay={path}: cannot read it ({e.strerror})") from None
    leaves: dict[int, str] = {}
    joined: dict[int, str] = {}
    for n, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
            for site in event["left"]:
                leaves.setdefault(int(site), str(event["after"]))
            for site in event.get("joined", []):
                joined.setdefault(int(site), str(event["at"]))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"replay={path}: line {n} is not a membership event") from None
    new = sorted(s for s in joined if s >= sites)  # sites added during the recorded run
    total = sites + len(new)
    bad = [s for s in {**leaves, **joined} if not 0 <= s < total]
    if bad or new != list(range(sites, total)):
        raise ConfigError(f"replay={path}: names sites {bad or new}, this run has 0..{sites - 1}")
    return leaves, joined


def run_sites(spec: RunSpec, workers: int) -> dict[str, Any] | None:
    """Start the lighthouse and one process per site; wait for the survivors; their summary.

    ``spec.resume``: a checkpoint folder; every site continues from its global copy. Without
    ``run_id=`` the run gets a fresh id (``lowcomm join`` reads it from DIR/elastic.json)."""
    m = spec.membership
    if not m.run_id:
        spec = spec.replace(membership=dataclasses.replace(m, run_id=fresh_run_id()))
    out_dir = spec.out
    out_dir.mkdir(parents=True, exist_ok=True)
    # sites fork from one server that imported torch and the trainer once: on a small machine
    # that saves each site its own ~2 s of imports (the server starts no threads, so a fork
    # from it is as clean as a spawn)
    ctx = mp.get_context("forkserver")
    # (torch._dynamo: what the first torch.optim optimizer of a process imports, ~0.4 s each)
    ctx.set_forkserver_preload(
        ["torch", "torch._dynamo", "lowcomm.train.loop", "lowcomm.train.join_site"]
    )
    servers: list[Any] = []
    address, keeper = spec.membership.lighthouse, None
    plan = site_plan(spec, workers)
    net = plan.network
    try:
        if not address:  # ours: at one address for the whole run, started again if it dies
            options = lighthouse_options(spec, min_replicas=1)  # lowcomm checks min_workers
            where = {"setup": net.lighthouse_setup(), "host": net.lighthouse_host} if net else {}
            secret = read_secret(spec.membership.secret_file)  # keyed: a front refuses strangers
            run_id = spec.membership.run_id
            keeper = Keeper(ctx, options, out_dir, secret=secret, run_id=run_id, **where)
            keeper.start()
            address = keeper.address
        return _run_sites(spec, workers, ctx, servers, address, keeper, plan)
    finally:
        if plan.close is not None:
            plan.close()
        if net is not None:
            net.close()


def fresh_run_id() -> str:
    """A run id no other run has (one per launch)."""
    return f"run-{secrets.token_hex(6)}"


def _run_sites(
    spec: RunSpec,
    workers: int,
    ctx: Any,
    servers: list[Any],
    address: str,
    keeper: Keeper | None,
    plan: SitePlan,
) -> dict[str, Any] | None:
    """Start every site (where ``plan``'s network puts it, if it has one) and wait for the
    survivors."""
    out_dir, net = spec.out, plan.network
    peer = ""
    own = spec.strategy.own_lighthouse(lighthouse_options(spec, spec.membership.min_workers))
    if own is not None:  # another library's membership (torchft's Managers): its own
        servers.append(own)
        peer = own.address()
    roles, again, added = _roles(spec, workers, address, peer, plan)
    clear_stale(out_dir)
    if spec.strategy.joinable:  # `lowcomm join DIR` starts another site from it
        planned = sorted([*again, *(r.site for r in added)])
        write_run_file(spec, roles[0], address, planned, netns=net is not None)
    started = time.time()

    def start(role: ElasticSite) -> Any:
        # a joiner heals from a live peer: it never reads the checkpoint
        own = spec.replace(resume=None) if role.join else spec
        if net is not None:
            staged = dataclasses.replace(role.staged, setup=net.site_setup(role.site, address))
            role = dataclasses.replace(role, staged=staged)
        p = ctx.Process(target=_site_main, args=(role, own))
        p.start()
        return p

    # added sites (``add:``) are started with the others: each asks to join until admitted
    procs = [start(role) for role in roles] + [start(role) for role in added]
    # a site that leaves and joins again (``join:`` or a replayed join) is started now, on
    # standby: it is ready (imports, data, model) when its gate opens, at the first's exit
    standby = {
        s: (gate, start(_standby(roles[s], gate, j)))
        for s, j in again.items()
        for gate in [ctx.Event()]
    }

    def restart(site: int) -> Any:
        """The site's standby process, let in (None: the site does not join again)."""
        if site not in standby:
            return None
        gate, p = standby.pop(site)
        print(f"lowcomm: site {site} starts again to join the run", flush=True)
        gate.set()
        return p

    def tick() -> None:
        if keeper is not None:
            keeper.tick()
            if plan.tick is not None:
                plan.tick(keeper)

    try:
        codes = _wait(procs, out_dir, restart, plan.pausing, started, tick)
    finally:
        # a second Ctrl-C must not cut the clean-up short (stale workers.json, live sites)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        # a hung site (SIGSTOP) is ended once the others are done, a standby never let in too
        for p in procs + [p for _, p in standby.values()]:
            if p.is_alive():
                p.kill()
        (out_dir / "workers.json").unlink(missing_ok=True)
        (out_dir / RUN_FILE).unlink(missing_ok=True)
        for server in servers:
            server.shutdown()
        if keeper is not None:
            keeper.stop()
        signal.signal(signal.SIGINT, previous)
    return _outcome(codes, out_dir, started)


def _roles(
    spec: RunSpec, workers: int, address: str, peer: str, plan: SitePlan
) -> tuple[list[ElasticSite], dict[int, dict[str, Any]], list[ElasticSite]]:
    """Each starting site's role; how each site that leaves and joins again is admitted; the
    roles of the sites added during the run (``plan.added``)."""
    m = spec.membership
    leaves, rejoins = _replayed(m.replay, workers) if m.replay else ({}, {})
    heal_at = tuple(rejoins.values())  # a replay: every site offers a heal where one joined
    total = workers + len(plan.added)  # the data is cut into as many shards as the run has sites
    roles = [
        ElasticSite(s, total, address, leaves.get(s, ""), peer, heal_at=heal_at, starting=workers)
        for s in range(workers)
    ]
    added = [
        dataclasses.replace(roles[0], site=s, leave_after="", join=True, **plan.added[s])
        for s in sorted(plan.added)
    ]
    # a site that leaves (killed, or a replay's leave) and joins again is started anew
    return roles, dict(plan.again), added


def _standby(role: ElasticSite, gate: Any, when: dict[str, Any]) -> ElasticSite:
    """The process of a site that joins again, started now and let in at ``gate``."""
    staged = dataclasses.replace(role.staged, gate=gate)
    return dataclasses.replace(role, leave_after="", join=True, staged=staged, **when)


def _wait(
    procs: list[Any],
    out_dir: Path,
    restart: Callable[[int], Any] | None = None,
    pausing: frozenset[int] | set[int] = frozenset(),
    started: float | None = None,
    tick: Callable[[], None] | None = None,
) -> list[int | None]:
    """Wait until every site has exited (or is stopped while the rest are done: a hang); a
    site that ``restart`` starts again (it returns the new process) is waited for anew, and a
    stopped site in ``pausing`` (a ``pause:`` fault) is still running: it comes back. Once the
    run's summary (written at ``started`` or later) exists, sites still running after
    ``FINISH_GRACE_S`` are behind for good and are ended. ``tick``: called every round (the
    lighthouse's keeper: it starts a dead lighthouse again)."""
    _write_workers(procs, out_dir)
    reported: set[int] = set()
    finished: float | None = None  # when the first site finished the run
    while True:
        for i, p in enumerate(procs):
            if p.exitcode is not None and i not in reported:
                reported.add(i)
                if p.exitcode != 0:
                    why = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit {p.exitcode}"
                    others = any(q.exitcode is None for q in procs)
                    tail = "; the others go on" if others and p.exitcode < 0 else ""
                    print(f"lowcomm: site {i} is gone ({why}){tail}{_said(out_dir, i)}", flush=True)
                if p.exitcode in (0, -signal.SIGKILL) and restart is not None:
                    again = restart(i)
                    if again is not None:
                        procs[i] = again
                        reported.discard(i)
                _write_workers(procs, out_dir)
        running = [
            p
            for i, p in enumerate(procs)
            if p.exitcode is None and (i in pausing or not _stopped(p.pid))
        ]
        if not running:
            return [p.exitcode for p in procs]
        if tick is not None:
            tick()
        if finished is None and started is not None and written_since(out_dir, started):
            finished = time.monotonic()  # a site that left on purpose (a replay) exits 0 too
        if finished is not None and time.monotonic() - finished > FINISH_GRACE_S:
            _end_laggards(procs)
            return [p.exitcode for p in procs]
        time.sleep(0.2)


def _end_laggards(procs: list[Any]) -> None:
    """The run is over (a site finished it) but these sites are still at an earlier sync
    (back from a pause, late in quorum rounds): nothing is left for them to join."""
    for i, p in enumerate(procs):
        if p.exitcode is None:
            print(
                f"lowcomm: site {i} was still behind {FINISH_GRACE_S:g} s after the run "
                f"finished: stopped",
                flush=True,
            )
            p.kill()
            p.join()


def _said(out_dir: Path, site: int) -> str:
    """': ' and the one line a site that stopped itself left (its error file), or the last line
    of the stack an unexpected failure left and where that stack is; or ''."""
    with contextlib.suppress(OSError):
        text = error_file(out_dir, site).read_text().strip()
        return f": {text}" if text else ""
    stack = failure_of(out_dir, site)
    return f": {stack}" if stack else ""


def _stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP: a hung site)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    return False


def _write_workers(procs: list[Any], out_dir: Path) -> None:
    """DIR/workers.json: the live sites' numbers and pids."""
    live = [{"site": i, "rank": i, "pid": p.pid} for i, p in enumerate(procs) if p.exitcode is None]
    tmp = out_dir / "workers.json.tmp"
    tmp.write_text(json.dumps(live, indent=2) + "\n")
    tmp.replace(out_dir / "workers.json")


def _outcome(codes: list[int | None], out_dir: Path, started: float) -> dict[str, Any] | None:
    """The survivors' summary, or the one line that says why the run stopped."""
    messages = user_errors(out_dir)
    summary = out_dir / "summary.json"
    # this run's summary (a resumed run's folder holds the one of before)
    if written_since(out_dir, started) and any(c == 0 for c in codes):
        return json.loads(summary.read_text())
    if 130 in codes:  # the sites were interrupted (Ctrl-C): said as for any interrupted run
        raise KeyboardInterrupt
    code = 2 if any(c == 2 for c in codes) else 1
    stacks = [s for s in (failure_of(out_dir, i) for i in range(len(codes))) if s]
    why = f"every site failed (exit codes {codes})" + (f": {stacks[0]}" if stacks else "")
    raise SitesFailed(messages or why, code)


def _site_main(role: ElasticSite, spec: RunSpec) -> None:
    """One site's process: the trainer with membership, its errors as a launched worker's."""
    if role.staged.setup is not None:  # before any socket (a network namespace, say)
        role.staged.setup()
    try:
        run_entry(str(spec.out), role.site, lambda: run_site(role, spec))
    except Exception:  # its stack is in its traceback file, which the launcher's line names
        sys.exit(1)
    # done, its files written: skip the native teardown (gloo, stores, the lighthouse client's
    # runtime), which took ~1.6 s a site here; the launcher waits for every site's exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
