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
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig
from ..elastic.membership import check_rounds
from ..elastic.rounds import LIGHTHOUSE_JOIN_S
from ..engine.placement import EVICT_SITE_RANKS, QUORUM_SITE_RANKS, TWO_PHASE_ELASTIC
from ..errors import LowCommError
from ..faults import (
    adds,
    decoded,
    joins,
    lighthouse_down,
    links,
    parse_faults,
    paused,
)
from .entry import clear_stale, error_file, failure_of, run_entry, user_errors
from .join_site import RUN_FILE, run_site, write_run_file
from .lighthouse import Keeper
from .site_role import SiteRole
from .spec import RunSpec

# after one site finished the run, how long the launcher waits for the others to finish too
# (they end at the same sync, within a moment) before it stops those still behind
FINISH_GRACE_S = 30.0


class SitesFailed(LowCommError):
    """No site finished the run: the message says why (one line per distinct reason)."""

    def __init__(self, message: str, exitcode: int) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def check_elastic(spec: RunSpec, workers: int) -> None:
    """One-line refusals of what elastic mode does not do, before any site starts."""
    cfg = spec.train
    faults = parse_faults(cfg.faults, workers, cfg.steps)
    rejoin = {**joins(faults), **adds(faults)}
    if decoded(faults) and (spec.strategy.per_step or spec.sync.resolved_reduce == "allreduce"):
        raise ConfigError(
            f"--faults {decoded(faults)[0]}: a corrupt payload is refused where payloads are "
            f"decoded; this run all-reduces sums: use a codec sent by reduce=gather or "
            f"two-phase (e.g. codec=int8)"
        )
    if not cfg.elastic:
        if rejoin:
            raise ConfigError(
                "--faults join/add: a site can join only an elastic run: add elastic=true"
            )
        if lighthouse_down(faults):
            raise ConfigError("--faults lighthouse: only an elastic run has one: add elastic=true")
        if links(faults):
            raise ConfigError("--faults link: cuts an elastic site's data plane: add elastic=true")
        if spec.sync.evict:
            raise ConfigError(
                "evict=true excludes named sites from an elastic run: add "
                "elastic=true (a fixed world only names them)"
            )
        return
    if links(faults) or cfg.site_link:
        _check_links(spec)
    spec.strategy.check_elastic(cfg, bool(rejoin))  # a replay's joins: refused with replay
    if lighthouse_down(faults) and cfg.lighthouse:
        raise ConfigError(
            f"--faults lighthouse: kills the lighthouse the launcher started; lighthouse="
            f"{cfg.lighthouse} is not ours to kill: drop lighthouse= or the fault"
        )
    if cfg.ranks_per_worker != 1 and cfg.site < 0:
        raise ConfigError(
            "elastic=true with --workers starts sites of one rank: launch each site of several "
            "ranks on its own (torchrun --nproc-per-node R ... site=N sites=S lighthouse=...)"
        )
    if cfg.ranks_per_worker != 1 and cfg.rounds == "quorum":
        raise ConfigError(QUORUM_SITE_RANKS)
    if cfg.ranks_per_worker != 1 and spec.sync.evict:
        raise ConfigError(EVICT_SITE_RANKS)
    if spec.sync.resolved_reduce == "two-phase":  # (the engine refuses it too, for own loops)
        raise ConfigError(TWO_PHASE_ELASTIC)
    if cfg.min_workers > workers:
        raise ConfigError(f"min_workers={cfg.min_workers} is more than --workers {workers}")
    if cfg.rounds == "quorum":
        if cfg.replay:  # where a round is cut short depends on timing, not on the record
            raise ConfigError("--replay re-enacts lock-step membership: drop rounds=quorum")
        check_rounds(cfg.rounds, cfg.quorum, cfg.grace, cfg.late, workers)
    if cfg.replay:
        replay_joins(cfg.replay, workers)  # the record read now: its errors before any start


def _check_links(spec: RunSpec) -> None:
    """A ``link:`` fault runs the sites in namespaces the launcher makes: refused, with the
    reason, where it cannot."""
    from ..netshape.errors import NetworkUnavailable
    from ..netshape.namespaces import require_root_and_iproute2

    cfg = spec.train
    what = f"site_link={cfg.site_link}" if cfg.site_link else "--faults link"
    if spec.strategy.peer:  # torchft's Managers meet at a lighthouse of this machine's own
        raise ConfigError(f"{what}: not for {spec.strategy.name}: use a lowcomm strategy")
    if cfg.replay:
        raise ConfigError(f"{what}: a replay runs without faults on loopback: drop {what}")
    if cfg.lighthouse:
        raise ConfigError(
            f"{what}: the sites then run in network namespaces that reach only the launcher's "
            f"lighthouse, not lighthouse={cfg.lighthouse}: drop lighthouse= or {what}"
        )
    try:
        require_root_and_iproute2()
    except NetworkUnavailable as e:
        raise ConfigError(f"{what}: {e}") from None


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

    ``spec.resume``: a checkpoint folder; every site continues from its global copy."""
    cfg, out_dir = spec.train, spec.out
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
    address, keeper = cfg.lighthouse, None
    net = _site_network(cfg, workers)
    try:
        if not address:  # ours: at one address for the whole run, started again if it dies
            options = _lighthouse_options(cfg, min_replicas=1)  # lowcomm checks min_workers
            where = {"netns": net.switch, "host": net.switch_addr} if net else {}
            keeper = Keeper(ctx, options, out_dir, **where)
            keeper.start()
            address = keeper.address
        return _run_sites(spec, workers, ctx, servers, address, keeper, net)
    finally:
        if net is not None:
            net.close()


def _site_network(cfg: TrainConfig, workers: int) -> Any:
    """A network namespace for each site and the lighthouse's, bridged (a ``link:`` fault
    cuts one site's link there); None for a run without such a fault."""
    faults = parse_faults(cfg.faults, workers, cfg.steps)
    if not links(faults) and not cfg.site_link:
        return None
    from ..netshape.network import ShapedNetwork

    total = workers + len(adds(faults))
    # without site_link a nominal rate: namespaces to cut one site's link in, not to shape it
    net = ShapedNetwork(
        cfg.site_link or "10gbit",
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
        servers.append(_lighthouse(cfg, min_replicas=cfg.min_workers))
        peer = servers[-1].address()
    roles, again, added = _plan(cfg, workers, address, peer)
    clear_stale(out_dir)
    if spec.strategy.joinable:  # `lowcomm join DIR` starts another site from it
        planned = sorted([*again, *(r.site for r in added)])
        write_run_file(spec, roles[0], address, planned, netns=net is not None)
    started = time.time()

    def start(role: SiteRole) -> Any:
        # a joiner heals from a live peer: it never reads the checkpoint
        own = spec.replace(resume=None) if role.join else spec
        if net is not None:
            role = dataclasses.replace(
                role, netns=net.namespace(role.site), addr=net.address(role.site), uplink=net.uplink
            )
        p = ctx.Process(target=_site_main, args=(role, own))
        p.start()
        return p

    # added sites (``add:``) are started with the others: each asks to join until admitted
    procs = [start(role) for role in roles] + [start(role) for role in added]
    # a site that leaves and joins again (``join:`` or a replayed join) is started now, on
    # standby: it is ready (imports, data, model) when its gate opens, at the first's exit
    standby = {
        s: (gate, start(dataclasses.replace(roles[s], leave_after="", join=True, gate=gate, **j)))
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

    pausing = {s for s in range(len(procs)) if paused(roles[0].faults, s)}
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
) -> tuple[list[SiteRole], dict[int, dict[str, Any]], list[SiteRole]]:
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
        SiteRole(
            s, total, address, faults, leaves.get(s, ""), peer, heal_at=heal_at, starting=workers
        )
        for s in range(workers)
    ]
    added = [
        dataclasses.replace(roles[0], site=s, leave_after="", join=True, **when[s]) for s in new
    ]
    # a site that leaves (killed, or a replay's leave) and joins again is started anew
    again = {s: j for s, j in when.items() if s < workers}
    return roles, again, added


def _lighthouse(cfg: TrainConfig, min_replicas: int) -> Any:
    """A torchft LighthouseServer in this process, with the run's timeouts (torchft's own
    Managers'; the sites' lighthouse is a :class:`Keeper`'s process)."""
    if not os.environ.get("LOWCOMM_DEBUG"):
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at INFO
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", **_lighthouse_options(cfg, min_replicas))


def _lighthouse_options(cfg: TrainConfig, min_replicas: int) -> dict[str, int]:
    """A lighthouse's settings for this run's timeouts."""
    # quorum rounds: the sites ask once a sync has closed, so the lighthouse waits only for
    # the rest of those asking (a moment), not for every live site as lock-step does
    join_s = LIGHTHOUSE_JOIN_S if cfg.rounds == "quorum" else cfg.timeout_s
    return {
        "min_replicas": min_replicas,
        "join_timeout_ms": int(join_s * 1000),
        "quorum_tick_ms": 20,
        "heartbeat_timeout_ms": int(cfg.heartbeat_timeout_s * 1000),
    }


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


def _site_main(role: SiteRole, spec: RunSpec) -> None:
    """One site's process: the trainer with membership, its errors as a launched worker's."""
    if role.netns:  # before any socket: its store and groups listen on its own address
        from ..netshape.links import WORKER_IFNAME
        from ..netshape.namespaces import enter

        enter(role.netns)
        os.environ.update(
            LOWCOMM_ADDR=role.addr,
            GLOO_SOCKET_IFNAME=WORKER_IFNAME,
            LOWCOMM_LIGHTHOUSE=role.lighthouse,
            LOWCOMM_UPLINK=role.uplink,
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
