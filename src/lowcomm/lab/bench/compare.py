"""`lowcomm compare`: several strategies on the same model, data and seed; one table and plots.

This module plans and launches the runs (each entry for each seed and bandwidth, plain or behind a
shaped link); :mod:`lowcomm.lab.bench.report` writes their table and plots (its names are importable
from here too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowcomm import strategies
from lowcomm.config import ConfigError, build_configs
from lowcomm.train.launch import LaunchError, launch
from lowcomm.train.spec import RunSpec
from lowcomm.train.summary import RunSummary

from .report import (  # noqa: F401  (re-exported: the report's names were importable from here)
    _write_json,
    _write_results_md,
    collect_runs,
    commands_list,
    ddp_reference,
    network_table,
    plot_results,
    provenance,
    results_table,
    seed_groups,
    seeds_table,
    time_to_loss,
    write_report,
)


@dataclass
class Entry:
    """One `--strategies` item: a strategy with its own overrides, e.g. sparseloco:density=1/32."""

    strategy: str
    overrides: dict[str, str] = field(default_factory=dict)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.strategy


def parse_entries(spec: str) -> list[Entry]:
    """`ddp,diloco:sync_every=50,sparseloco:density=1/32` -> entries with unique names."""
    out: list[Entry] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        parts = item.split(":")
        strategy = strategies.get(parts[0]).name
        overrides: dict[str, str] = {}
        for kv in parts[1:]:
            if "=" not in kv:
                raise ConfigError(
                    f"'{kv}' in '{item}' is not key=value (e.g. sparseloco:density=1/32)"
                )
            k, v = kv.split("=", 1)
            overrides[k] = v
        label = strategy + "".join(f"-{k}={v}" for k, v in overrides.items())
        out.append(Entry(strategy, overrides, label.replace("/", "_")))
    if not out:
        raise ConfigError("--strategies is empty: give e.g. ddp,diloco")
    names = [e.name for e in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(
            f"--strategies lists {sorted(dup)} twice: give each entry different overrides"
        )
    return out


def run_compare(
    entries: list[Entry],
    common: dict[str, Any],
    workers: int,
    seeds: list[int],
    out_dir: Path,
    port: int | None = None,
    bandwidths: list[str] | None = None,
    topology: str = "shared",
    command: str | None = None,
) -> list[RunSummary]:
    """Run every entry for every seed (and bandwidth), one after another.

    Writes results.json, results.md and the plots. With ``bandwidths``, each run's workers sit
    behind a kernel-shaped link (see :mod:`lowcomm.lab.netshape`), set up and checked once per
    bandwidth and torn down after it. ``command`` (the command line) heads results.md.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    plans = _plan(
        entries, common, seeds, workers
    )  # every configuration checked before the first run
    results: list[RunSummary] = []
    failed: list[str] = []
    for bw in bandwidths or [None]:
        net = _open_network(bw, topology, workers)
        try:
            for e, seed, values, configs in plans:
                name = (
                    e.name + (f"-{bw}" if bw else "") + (f"-seed{seed}" if len(seeds) > 1 else "")
                )
                print(
                    f"[compare] {name}: {e.strategy}, {workers} workers, "
                    f"{configs.train.steps} steps",
                    flush=True,
                )
                try:
                    if net is None:
                        spec = RunSpec.of(e.strategy, configs, out_dir / name, name)
                        raw = launch(spec, workers, port)
                    else:
                        raw = launch_shaped(net, e.strategy, values, out_dir / name, name)
                        raw.update(
                            bandwidth=bw, topology=topology, measured_link_mbit=net.measured_mbit
                        )
                except LaunchError as err:
                    if err.exitcode in (2, 130):  # a user error (every run would hit it), Ctrl-C
                        raise
                    # one lost run must not cost the rest of a sweep: note it, go on,
                    # fail at the end
                    print(
                        f"error: {err}; going on with the other runs", file=sys.stderr, flush=True
                    )
                    failed.append(name)
                    continue
                if raw is None:
                    continue
                summary = RunSummary.from_dict(raw)
                summary.entry = e.name  # what `report` groups seeds and links by
                summary.write(out_dir / name / "summary.json")
                results.append(summary)
                _write_json(results, out_dir / "results.json")
        finally:
            if net is not None:
                net.close()
    _write_results_md(out_dir, results_table(results) + commands_list(results), command)
    plot_results(results, out_dir, subtitle=provenance(command))
    if failed:
        raise LaunchError(
            f"{len(failed)} of {len(failed) + len(results)} runs failed "
            f"({', '.join(failed)}); the others are in {out_dir / 'results.md'}: re-run "
            f"the failed ones with `lowcomm compare --strategies ...` and merge them "
            f"with `lowcomm report`"
        )
    return results


def _plan(
    entries: list[Entry], common: dict[str, Any], seeds: list[int], workers: int
) -> list[tuple]:
    """(entry, seed, values, settings tree) of every run, each config validated."""
    plans = []
    for seed in seeds:
        for e in entries:
            values = {**common, **e.overrides, "seed": seed}
            strategy = strategies.get(e.strategy)
            configs = build_configs(values, sync=strategy.config(workers))
            strategy.check(configs.sync, configs.train, None)
            plans.append((e, seed, values, configs))
    return plans


def _open_network(bw: str | None, topology: str, workers: int) -> Any:
    """A shaped link of rate ``bw`` (entered), or None for an unshaped run."""
    if bw is None:
        return None
    from ..netshape import ShapedNetwork

    # per-node: a worker's namespace holds all its ranks (launch_shaped); the links are per worker
    shape = "per-worker" if topology == "per-node" else topology
    net = ShapedNetwork(bw, topology=shape, workers=workers)
    net.__enter__()
    print(f"[compare] link {bw} ({topology}): measured {net.measured_mbit:.1f} Mbit/s", flush=True)
    return net


def launch_shaped(
    net: Any, strategy: str, values: dict[str, Any], out_dir: Path, name: str
) -> dict[str, Any]:
    """Start each worker in its namespace (torchrun-style env), one core each; rank 0's summary.

    One code path for both topologies: in ``shared`` every rank's namespace is the same one.
    """
    # --overwrite: a re-run of the sweep replaces its earlier run, as unshaped entries do
    argv = [
        sys.executable,
        "-m",
        "lowcomm.lab",
        "train",
        "--strategy",
        strategy,
        "--overwrite",
        "--out",
        str(out_dir),
        *[f"{k}={v}" for k, v in values.items()],
        "progress=false",
    ]
    cores = os.cpu_count() or 1
    per = int(values.get("ranks_per_worker", 1))  # ranks in each worker's namespace
    procs = []
    for rank in range(net.workers * per):
        site = rank // per
        env = {
            **os.environ,
            **net.env(site),
            "RANK": str(rank),
            "WORLD_SIZE": str(net.workers * per),
            "LOCAL_RANK": str(rank % per if per > 1 else rank),
            "LOCAL_WORLD_SIZE": str(per if per > 1 else net.workers),
        }
        env.pop("LOWCOMM_LAUNCHED", None)
        cmd = net.command(site, ["taskset", "-c", str(rank % cores), *argv])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if rank else None))
    codes = [None] * len(procs)
    try:
        while any(c is None for c in codes):
            for r, p in enumerate(procs):
                if codes[r] is None:
                    try:
                        codes[r] = p.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        continue
                    if codes[r] != 0:
                        raise LaunchError(
                            f"{name}: worker {r} failed with exit code {codes[r]}",
                            2 if codes[r] == 2 else 1,
                        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    summary = json.loads((out_dir / "summary.json").read_text())
    summary["name"] = name
    return summary
