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
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig
from ..elastic.admission import read_secret
from ..errors import LowCommError
from ..faults import Staged, adds, joins, links, parse_faults, paused
from .entry import clear_stale, error_file, failure_of, run_entry, user_errors
from .join_site import RUN_FILE, run_site, write_run_file
from .lighthouse import Keeper
from .site_role import ElasticSite
from .spec import ElasticSpec, RunSpec, check_corrupt, check_fixed

# after one site finished the run, how long the launcher waits for the others to finish too
# (they end at the same sync, within a moment) before it stops those still behind
FINISH_GRACE_S = 30.0


class SitesFailed(LowCommError):
    """No site finished the run: the message says why (one line per distinct reason)."""

    def __init__(self, message: str, exitcode: int) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def check_elastic(spec: RunSpec, workers: int) -> None:
    """One-line refusals of what the run's elastic settings (or their absence) cannot do,
    before any site starts."""
    faults = parse_faults(spec.train.faults, workers, spec.train.steps)
    check_corrupt(spec, faults)
    if spec.elastic is None:
        check_fixed(spec, faults)
        return
    spec.elastic.check(spec, workers, faults)
    if spec.elastic.replay:
        replay_joins(spec.elastic.replay, workers)  # read now: its errors before any start


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
    if not spec.train.run_id:
        spec = spec.replace(train=dataclasses.replace(spec.train, run_id=fresh_run_id()))
    settings, out_dir = _settings(spec), spec.out
    out_dir.mkdir(parents=True, exist_ok=True)
    # sites fork from one server that imported torch and the trainer once: on a small machine
    # that saves each site its own ~2 s of imports (the server starts no threads, so a fork
    # from it is as clean as a spawn)
    ctx = mp.get_context("forkserver")
    # (torch._dynamo: what the first torch.optim optimizer of a process imports, ~0.4 s each)
    ctx.set_forkserver_preload(
        ["torch", "torch._dynamo", "lowcomm.train.loop", "lowcomm.train.join_site"]
    )
    servers = []
    address, keeper = settings.lighthouse, None
    net = _site_network(spec, workers)
    try:
        if not address:  # ours: at one address for the whole run, started again if it dies
            options = settings.lighthouse_options(min_replicas=1)  # lowcomm checks min_workers
            where = {"netns": net.switch, "host": net.switch_addr} if net else {}
            secret = read_secret(spec.train.secret_file)  # keyed: a front refuses strangers
            run_id = spec.train.run_id
            keeper = Keeper(ctx, options, out_dir, secret=secret, run_id=run_id, **where)
            keeper.start()
            address = keeper.address
        return _run_sites(spec, workers, ctx, servers, address, keeper, net)
    finally:
        if net is not None:
            net.close()


def fresh_run_id() -> str:
    """A run id no other run has (one per launch)."""
    return f"run-{secrets.token_hex(6)}"


def _settings(spec: RunSpec) -> ElasticSpec:
    """The elastic settings of ``spec`` (a run of sites has them)."""
    assert spec.elastic is not None, "sites run an elastic run"
    return spec.elastic


def _site_network(spec: RunSpec, workers: int) -> Any:
    """A network namespace for each site and the lighthouse's, bridged (a ``link:`` fault
    cuts one site's link there); None for a run without such a fault."""
    cfg, settings = spec.train, _settings(spec)
    faults = parse_faults(cfg.faults, workers, cfg.steps)
    if not links(faults) and not settings.site_link:
        return None
    from ..netshape.network import ShapedNetwork

    total = workers + len(adds(faults))
    # without site_link a nominal rate: namespaces to cut one site's link in, not to shape it
    net = ShapedNetwork(
        settings.site_link or "10gbit",
        topology="per-worker",
        workers=total,
        check=False,
        name_prefix="lcsites",
    )
    return net.__enter__()


def _run_sites(
    spec: RunSpec,
    workers: int,
    ctx: Any,
    servers: list[Any],
    address: str,
    keeper: Any,
    net: Any,
) -> dict[str, Any] | None:
    """Start every site (in its namespace of ``net`` if any) and wait for the survivors."""
    cfg, out_dir = spec.train, spec.out
    peer = ""
    if spec.strategy.peer:  # torchft's Managers: a lighthouse of their own
        servers.append(_lighthouse(_settings(spec), min_replicas=_settings(spec).min_workers))
        peer = servers[-1].address()
    roles, again, added = _plan(cfg, workers, address, peer)
    clear_stale(out_dir)
    if spec.strategy.joinable:  # `lowcomm join DIR` starts another site from it
        planned = sorted([*again, *(r.site for r in added)])
        write_run_file(spec, roles[0], address, planned, netns=net is not None)
    started = time.time()

    def start(role: ElasticSite) -> Any:
        # a joiner heals from a live peer: it never reads the checkpoint
        own = spec.replace(resume=None) if role.join else spec
        if net is not None:
            where = {"netns": net.namespace(role.site), "addr": net.address(role.site)}
            staged = dataclasses.replace(role.staged, **where, uplink=net.uplink)
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

    pausing = {s for s in range(len(procs)) if paused(list(roles[0].staged.faults), s)}
    try:
        codes = _wait(procs, out_dir, restart, pausing, started, keeper and keeper.tick)
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


def _plan(
    cfg: TrainConfig, workers: int, address: str, peer: str
) -> tuple[list[ElasticSite], dict[int, dict[str, Any]], list[ElasticSite]]:
    """Each starting site's role; how each site that leaves and joins again is admitted; the
    roles of the sites added during the run (``add:``, or new sites in a replay's joins)."""
    faults = parse_faults(cfg.faults, workers, cfg.steps)
    leaves, rejoins = _replayed(cfg.replay, workers) if cfg.replay else ({}, {})
    when: dict[int, dict[str, Any]] = {s: {"join_at": t} for s, t in rejoins.items()} or {
        s: {"join_from": n} for s, n in {**joins(faults), **adds(faults)}.items()
    }
    new = sorted(s for s in when if s >= workers)
    heal_at = tuple(rejoins.values())  # a replay: every site offers a heal where one joined
    total = workers + len(new)  # the data is cut into as many shards as the run has sites
    roles = [
        ElasticSite(
            s,
            total,
            address,
            leaves.get(s, ""),
            peer,
            heal_at=heal_at,
            starting=workers,
            staged=Staged(tuple(faults)),
        )  # fmt: skip
        for s in range(workers)
    ]
    added = [
        dataclasses.replace(roles[0], site=s, leave_after="", join=True, **when[s]) for s in new
    ]
    # a site that leaves (killed, or a replay's leave) and joins again is started anew
    again = {s: j for s, j in when.items() if s < workers}
    return roles, again, added


def _standby(role: ElasticSite, gate: Any, when: dict[str, Any]) -> ElasticSite:
    """The process of a site that joins again, started now and let in at ``gate``."""
    staged = dataclasses.replace(role.staged, gate=gate)
    return dataclasses.replace(role, leave_after="", join=True, staged=staged, **when)


def _lighthouse(settings: ElasticSpec, min_replicas: int) -> Any:
    """A torchft LighthouseServer in this process, with the run's timeouts (torchft's own
    Managers'; the sites' lighthouse is a :class:`Keeper`'s process)."""
    if not os.environ.get("LOWCOMM_DEBUG"):
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", **settings.lighthouse_options(min_replicas))


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
        if finished is None and started is not None and _summarized(out_dir, started):
            finished = time.monotonic()  # a site that left on purpose (a replay) exits 0 too
        if finished is not None and time.monotonic() - finished > FINISH_GRACE_S:
            _end_laggards(procs)
            return [p.exitcode for p in procs]
        time.sleep(0.2)


def _summarized(out_dir: Path, started: float) -> bool:
    """Whether this run's summary has been written: the run is over."""
    with contextlib.suppress(OSError):
        return (out_dir / "summary.json").stat().st_mtime >= started
    return False


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
    if summary.exists() and summary.stat().st_mtime >= started and any(c == 0 for c in codes):
        return json.loads(summary.read_text())
    if 130 in codes:  # the sites were interrupted (Ctrl-C): said as for any interrupted run
        raise KeyboardInterrupt
    code = 2 if any(c == 2 for c in codes) else 1
    stacks = [s for s in (failure_of(out_dir, i) for i in range(len(codes))) if s]
    why = f"every site failed (exit codes {codes})" + (f": {stacks[0]}" if stacks else "")
    raise SitesFailed(messages or why, code)


def _site_main(role: ElasticSite, spec: RunSpec) -> None:
    """One site's process: the trainer with membership, its errors as a launched worker's."""
    staged = role.staged
    if staged.netns:  # before any socket: its store and groups listen on its own address
        from ..netshape.links import WORKER_IFNAME
        from ..netshape.namespaces import enter

        enter(staged.netns)
        os.environ.update(
            LOWCOMM_ADDR=staged.addr,
            GLOO_SOCKET_IFNAME=WORKER_IFNAME,
            LOWCOMM_LIGHTHOUSE=role.lighthouse,
            LOWCOMM_UPLINK=staged.uplink,
        )
    try:
        run_entry(str(spec.out), role.site, lambda: run_site(role, spec))
    except Exception:  # its stack is in its traceback file, which the launcher's line names
        sys.exit(1)
    # done, its files written: skip the native teardown (gloo, stores, the lighthouse client's
    # runtime), which took ~1.6 s a site here; the launcher waits for every site's exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
