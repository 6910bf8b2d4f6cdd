"""``lowcomm join DIR``: one more site for the elastic run going in DIR, started by hand.

The launcher of an elastic run writes ``DIR/elastic.json`` (the run's settings and its
lighthouse) while the run goes on. A site started from it takes the number of a site that has
left (``workers.json`` lists the launcher's live sites; ``DIR/join-siteN.pid`` marks one
already started by hand), joins the run at its next sync, heals from a live peer, trains on its
own data shard from the run's step, and exits when the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..config import SAVED_BEFORE, ConfigError, SyncConfig, build_configs, config_fields
from ..errors import SiteLeft
from .site_role import ElasticSite
from .spec import RunSpec, saved_values

RUN_FILE = "elastic.json"


def write_run_file(
    spec: RunSpec, role: ElasticSite, lighthouse: str, planned: list[int], netns: bool = False
) -> None:
    """DIR/elastic.json: what ``lowcomm join DIR`` needs (the launcher removes it at the end);
    ``role``: a starting site's, for the run's sites; ``planned``: the sites the launcher
    itself starts again or adds (``join:``, ``add:``, a replay's), never free to take;
    ``netns``: the sites run in namespaces of the launcher's (no site from outside reaches them)."""
    record = {
        "run": spec.settings(),
        "sites": role.sites,
        "starting": role.starting or role.sites,
        "lighthouse": lighthouse,
        "launcher": os.getpid(),
        "planned": planned,
        "netns": netns,
    }
    tmp = spec.out / f"{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(spec.out / RUN_FILE)


def join_site(run_dir: str, site: int | None = None) -> None:
    """Start a site of the elastic run going in ``run_dir`` (this process), as a joiner; it
    returns when the run ends. ConfigError, before anything starts, when there is none to join."""
    folder = Path(run_dir)
    record = _running(folder)
    if record.get("netns"):
        raise ConfigError(
            f"the run in {run_dir} keeps its sites in network namespaces of its own (site_link= "
            f"or a link: fault): a site started here cannot reach them; use --faults join: instead"
        )
    sites = int(record["sites"])
    site = _free_site(folder, sites, site, set(record.get("planned", [])))
    run = record["run"]
    known = config_fields()
    saved = {k: v for k, v in {**SAVED_BEFORE, **saved_values(run)}.items() if k in known}
    configs = build_configs(saved, sync=SyncConfig())
    # the run's extensions (its faults) and its replay are its launcher's
    membership = dataclasses.replace(configs.membership, replay="")
    configs = dataclasses.replace(configs, membership=membership, extensions={})
    starting = int(record.get("starting", sites))
    role = ElasticSite(site, sites, record["lighthouse"], join=True, starting=starting)
    if not os.environ.get("LOWCOMM_DEBUG"):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's client logs at INFO
    lock = folder / f"join-site{site}.pid"
    lock.write_text(f"{os.getpid()}\n")
    print(f"lowcomm: site {site} joins the run in {folder} at its next sync", flush=True)
    try:
        run_site(role, RunSpec.of(run["strategy"], configs, folder, run.get("name")))
    finally:
        lock.unlink(missing_ok=True)


def _running(folder: Path) -> dict[str, Any]:
    """The run file of the elastic run going in ``folder``, or a one-line ConfigError."""
    path = folder / RUN_FILE
    if not path.exists():
        raise ConfigError(
            f"lowcomm join {folder}: no elastic run is going there (it has no {RUN_FILE}): "
            f"start one with `lowcomm train ... elastic=true --out {folder}`"
        )
    record = json.loads(path.read_text())
    if not _alive(int(record["launcher"])):
        raise ConfigError(
            f"lowcomm join {folder}: the run's launcher (pid {record['launcher']}) is gone: "
            f"resume it with `lowcomm train --resume {folder}`"
        )
    return record


def _free_site(folder: Path, sites: int, asked: int | None, planned: set[int]) -> int:
    """A site number of the run that no live process holds and the launcher does not start
    again itself (``planned``): ``asked``, or the lowest."""
    live: set[int] = set(planned)
    with contextlib.suppress(OSError, ValueError):
        live |= {int(w["site"]) for w in json.loads((folder / "workers.json").read_text())}
    for lock in folder.glob("join-site*.pid"):
        with contextlib.suppress(OSError, ValueError):
            if _alive(int(lock.read_text())):
                live.add(int(lock.stem.removeprefix("join-site")))
    free = [s for s in range(sites) if s not in live]
    if asked is not None:
        if not 0 <= asked < sites or asked in live:
            raise ConfigError(
                f"lowcomm join {folder}: site {asked} is not free (the run's sites are "
                f"0..{sites - 1}; taken: {sorted(live)}); drop --site to take a free one"
            )
        return asked
    if not free:
        raise ConfigError(
            f"lowcomm join {folder}: all {sites} sites of the run are running: none to replace "
            f"(a site beyond them cannot be added by hand yet; --faults add:{sites}@STEP plans "
            f"one)"
        )
    return free[0]


def run_site(role: ElasticSite, spec: RunSpec) -> dict[str, Any] | None:
    """The trainer as one site, in a torch.distributed world of its own (the launcher's sites,
    a site started by hand and one launched on its own alike); its summary (None where
    another site writes the run's)."""
    from .loop import run_worker

    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a site of several ranks: its torchrun
            return run_worker(spec, role=role)  # world, which set_up joins (and leaves)
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=spec.train.timeout_s),
        )
        try:
            return run_worker(spec, role=role)
        finally:
            dist.destroy_process_group()
    except SiteLeft:  # a replay left the run where the recorded site did: it ends here, done
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True
