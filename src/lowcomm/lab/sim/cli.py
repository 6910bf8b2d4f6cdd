"""`lowcomm simulate`: the planner's view of the compute-utilization model.

The lead's ``lowcomm.cli`` wires the subcommand to :func:`add_arguments` and :func:`run`.
Numpy and the standard library only, so it works without torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .fromrun import RunError, load_run
from .model import (
    GRID,
    PRESETS,
    ROW_LABELS,
    TARGETS,
    Link,
    Strategy,
    Workload,
    bandwidth_grid,
    make_strategies,
    simulate,
)

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class UsageError(ValueError):
    """Bad command-line input; printed as one line, exit status 2."""


def _count(text: str, what: str) -> float:
    """'1e9', '70b', '1.5T', '125m' -> a positive number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kmbgtKMBGT]?)\s*", str(text))
    if not m:
        raise UsageError(f"{what} must be a positive number such as 1e9 or 70b, got '{text}'")
    value = float(m.group(1)) * (_SUFFIX[m.group(2).lower()] if m.group(2) else 1.0)
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"{what} must be positive, got '{text}'")
    return value


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise UsageError(
            f"{what} must be a comma-separated list of numbers, got '{text}'"
        ) from None
    if not vals:
        raise UsageError(f"{what} is empty")
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `lowcomm simulate`. Numbers are validated by :func:`run`, not by argparse."""
    g = parser.add_argument_group("model (a preset, or your own numbers)")
    g.add_argument(
        "--model",
        metavar="NAME",
        help=f"preset from the Streaming DiLoCo paper: {', '.join(PRESETS)} "
        "(its layers, parameters and step time; M = 2, H = 100, 3-layer fragments)",
    )
    g.add_argument("--layers", metavar="L", help="transformer layers")
    g.add_argument("--params", metavar="N", help="parameters, e.g. 1e9 or 70b")
    g.add_argument("--step-time", metavar="S", help="seconds of pure compute per inner step")
    g.add_argument(
        "--flops-per-step",
        metavar="F",
        help="instead of --step-time: FLOPs of one inner step (about 6 x N x tokens)",
    )
    g.add_argument(
        "--tokens-per-step",
        metavar="T",
        help="instead of --flops-per-step: tokens per inner step per worker (F = 6 N T)",
    )
    g.add_argument("--chips", metavar="C", help="accelerators per worker (with --flops-per-step)")
    g.add_argument("--peak-flops", metavar="P", help="peak FLOP/s of one accelerator, e.g. 989e12")
    g.add_argument("--mfu", metavar="U", help="model FLOPs utilization, a fraction (e.g. 0.4)")
    g = parser.add_argument_group("training and network")
    g.add_argument("--workers", metavar="M", help="workers (replica groups); default 2")
    g.add_argument("--sync-every", metavar="H", help="inner steps between syncs; default 100")
    g.add_argument(
        "--blocks-per-fragment", metavar="B", help="streaming: layers per fragment; default 3"
    )
    g.add_argument("--pattern", default="strided", help="streaming: strided | sequential")
    g.add_argument(
        "--overlap",
        metavar="TAU",
        default="1",
        help="streaming rows with overlap: inner steps a transfer may overlap; default 1",
    )
    g.add_argument(
        "--density",
        metavar="D",
        default=str(1 / 64),
        help="SparseLoCo: kept fraction; default 1/64 (12-bit index + 2-bit value each)",
    )
    g.add_argument(
        "--latency",
        metavar="MS",
        default="0",
        help="one-way link latency in milliseconds, paid per ring hop; default 0",
    )
    g.add_argument(
        "--wire-scale",
        metavar="X",
        default="1",
        help="multiply every transfer's bits; 1 = physical; 0.84 reproduces the paper's table",
    )
    _add_output_arguments(parser)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """The "output" group of :func:`add_arguments`."""
    g = parser.add_argument_group("output")
    g.add_argument(
        "--strategies",
        metavar="LIST",
        help=f"rows to print, comma-separated: {', '.join(ROW_LABELS)} (default all)",
    )
    g.add_argument(
        "--targets", metavar="LIST", help="utilization targets; default 0.5,0.8,0.9,0.95,0.99"
    )
    g.add_argument(
        "--bandwidths",
        metavar="LIST",
        help="also print the utilization at these Gbit/s (e.g. 0.1,1,10)",
    )
    g.add_argument(
        "--grid",
        metavar="MIN,MAX,POINTS",
        help="bandwidth grid in Gbit/s; default 0.1,1000,50 (0.001,1000,74 with --from-run)",
    )
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument(
        "--from-run",
        metavar="DIR",
        help="predict a measured run (DIR/summary.json) at other bandwidths",
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _json_num(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def _grid(args: argparse.Namespace, default: tuple[float, float, int]) -> np.ndarray:
    if args.grid is None:
        return GRID if default == (0.1, 1000.0, 50) else bandwidth_grid(*default)
    vals = _floats(args.grid, "--grid")
    if len(vals) != 3 or vals[2] != int(vals[2]):
        raise UsageError(f"--grid takes MIN,MAX,POINTS, got '{args.grid}'")
    try:
        return bandwidth_grid(vals[0], vals[1], int(vals[2]))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _targets(args: argparse.Namespace) -> list[float]:
    if args.targets is None:
        return list(TARGETS)
    vals = _floats(args.targets, "--targets")
    if any(not 0 < v <= 1 for v in vals):
        raise UsageError(f"--targets are fractions in (0, 1], got '{args.targets}'")
    return vals


def _int(text: Any, what: str, minimum: int) -> int:
    try:
        val = int(str(text))
    except ValueError:
        raise UsageError(f"{what} must be an integer, got '{text}'") from None
    if val < minimum:
        raise UsageError(f"{what} must be >= {minimum}, got {val}")
    return val


def _nonneg(text: Any, what: str) -> float:
    try:
        val = float(str(text))
    except ValueError:
        raise UsageError(f"{what} must be a number, got '{text}'") from None
    if not (val >= 0 and math.isfinite(val)):
        raise UsageError(f"{what} must be >= 0, got '{text}'")
    return val


def _workload(args: argparse.Namespace) -> tuple[Workload, dict[str, int]]:
    """The workload and the preset's run defaults (workers, sync_every, blocks_per_fragment)."""
    defaults = {"workers": 2, "sync_every": 100, "blocks_per_fragment": 3}
    base: Workload | None = None
    if args.model is not None:
        key = str(args.model).lower()
        if key not in PRESETS:
            raise UsageError(
                f"unknown model preset '{args.model}': choose one of {', '.join(PRESETS)}"
            )
        preset = PRESETS[key]
        base = preset.workload
        defaults = {
            "workers": preset.workers,
            "sync_every": preset.sync_every,
            "blocks_per_fragment": preset.blocks_per_fragment,
        }
    params = (
        _count(args.params, "--params")
        if args.params is not None
        else (base.params if base else None)
    )
    layers = (
        _int(args.layers, "--layers", 1)
        if args.layers is not None
        else (base.layers if base else None)
    )
    step = _step_time(args, params, base)
    missing = [
        f
        for f, v in (
            ("--params", params),
            ("--layers", layers),
            ("--step-time (or --flops-per-step/--tokens-per-step)", step),
        )
        if v is None
    ]
    if missing:
        raise UsageError(f"give --model {'|'.join(PRESETS)} or {', '.join(missing)}")
    custom = base is None or any(
        v is not None
        for v in (
            args.params,
            args.layers,
            args.step_time,
            args.flops_per_step,
            args.tokens_per_step,
        )
    )
    name = "custom" if base is None else (f"{base.name}-custom" if custom else base.name)
    return Workload(
        params=float(params), layers=int(layers), step_time_s=float(step), name=name
    ), defaults


def _step_time(
    args: argparse.Namespace, params: float | None, base: Workload | None
) -> float | None:
    """Seconds of compute per inner step: --step-time, else from FLOPs, else the preset's."""
    if args.step_time is not None:
        return _count(args.step_time, "--step-time")
    if args.flops_per_step is not None or args.tokens_per_step is not None:
        if params is None:
            raise UsageError("--tokens-per-step needs --params (FLOPs = 6 x params x tokens)")
        flops = (
            _count(args.flops_per_step, "--flops-per-step")
            if args.flops_per_step is not None
            else 6.0 * params * _count(args.tokens_per_step, "--tokens-per-step")
        )
        need = [
            f
            for f, v in (
                ("--chips", args.chips),
                ("--peak-flops", args.peak_flops),
                ("--mfu", args.mfu),
            )
            if v is None
        ]
        if need:
            raise UsageError(f"a step time from FLOPs also needs {', '.join(need)}")
        mfu = _count(args.mfu, "--mfu")
        if mfu > 1:
            raise UsageError(f"--mfu is a fraction in (0, 1], got '{args.mfu}'")
        return flops / (
            _count(args.chips, "--chips") * _count(args.peak_flops, "--peak-flops") * mfu
        )
    if base is not None:
        return base.step_time_s
    return None


def _rows(args: argparse.Namespace, strategies: dict[str, Strategy]) -> dict[str, Strategy]:
    if args.strategies is None:
        return strategies
    names = [s.strip() for s in str(args.strategies).split(",") if s.strip()]
    unknown = [n for n in names if n not in strategies]
    if unknown or not names:
        raise UsageError(
            f"unknown strategies {unknown or names}: choose from {', '.join(strategies)}"
        )
    return {n: strategies[n] for n in names}


def _header(w: Workload, link: Link, h: int, bpf: int, grid: np.ndarray) -> str:
    return (
        f"{w.name}: {w.params:.3g} parameters, {w.layers} layers, {w.step_time_s:.4g} s per "
        f"inner step; M = {link.workers}, H = {h}, {bpf} layers per fragment, latency "
        f"{link.latency_s * 1e3:g} ms, wire scale {link.wire_scale:g}\n"
        f"Gbit/s per worker link to reach each compute utilization: the first point of a "
        f"{grid.size}-point log grid from {grid[0]:.4g} to {grid[-1]:.4g} ('-' = none)"
    )


def _table(
    rows: dict[str, list[float | None]],
    targets: list[float],
    labels: dict[str, str],
    floor: float | None = None,
) -> str:
    """Rows of minimum bandwidths; a value equal to the grid's first point prints as <=floor."""
    width = max(len(labels.get(k, k)) for k in rows) + 2
    head = "method".ljust(width) + "".join(f"{t * 100:>9g}%" for t in targets)
    lines = [head, "-" * len(head)]
    for key, vals in rows.items():
        cells = [
            ("<=" + _fmt(v)) if floor is not None and v is not None and v <= floor else _fmt(v)
            for v in vals
        ]
        lines.append(labels.get(key, key).ljust(width) + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def _util_table(at: list[float], utils: dict[str, list[float]], labels: dict[str, str]) -> str:
    width = max(len(labels.get(k, k)) for k in utils) + 2
    lines = [
        "compute utilization at the given bandwidths (Gbit/s)",
        "method".ljust(width) + "".join(f"{b:>10g}" for b in at),
    ]
    for key, vals in utils.items():
        lines.append(labels.get(key, key).ljust(width) + "".join(f"{u:>10.3f}" for u in vals))
    return "\n".join(lines)


def _simulate_model(args: argparse.Namespace) -> int:
    workload, defaults = _workload(args)
    workers = (
        _int(args.workers, "--workers", 2) if args.workers is not None else defaults["workers"]
    )
    h = (
        _int(args.sync_every, "--sync-every", 1)
        if args.sync_every is not None
        else defaults["sync_every"]
    )
    bpf = (
        _int(args.blocks_per_fragment, "--blocks-per-fragment", 1)
        if args.blocks_per_fragment is not None
        else defaults["blocks_per_fragment"]
    )
    if args.pattern not in ("strided", "sequential"):
        raise UsageError(f"--pattern must be strided or sequential, got '{args.pattern}'")
    density = _nonneg(args.density, "--density")
    if not 0 < density <= 1:
        raise UsageError(f"--density must be in (0, 1], got '{args.density}'")
    link = Link(
        workers, _nonneg(args.latency, "--latency") * 1e-3, _count(args.wire_scale, "--wire-scale")
    )
    strategies = _rows(
        args,
        make_strategies(
            workload,
            sync_every=h,
            blocks_per_fragment=bpf,
            pattern=args.pattern,
            overlap=_int(args.overlap, "--overlap", 0),
            density=density,
        ),
    )
    targets, grid = _targets(args), _grid(args, (0.1, 1000.0, 50))
    results = {k: simulate(workload, s, grid, link) for k, s in strategies.items()}
    rows = {k: r.min_bandwidth(targets) for k, r in results.items()}
    extra = None
    if args.bandwidths is not None:
        at = _floats(args.bandwidths, "--bandwidths")
        if any(b <= 0 for b in at):
            raise UsageError(f"--bandwidths must be positive, got '{args.bandwidths}'")
        extra = (
            at,
            {
                k: simulate(workload, s, at, link).utilization.tolist()
                for k, s in strategies.items()
            },
        )
    if args.json:
        out: dict[str, Any] = {
            "model": workload.name,
            "targets": targets,
            "rows": {k: [_json_num(v) for v in vals] for k, vals in rows.items()},
        }
        if extra is not None:
            out["utilization"] = {
                "bandwidths_gbps": extra[0],
                **{k: [round(u, 4) for u in v] for k, v in extra[1].items()},
            }
        print(json.dumps(out))
        return 0
    print(_header(workload, link, h, bpf, grid))
    print(_table(rows, targets, ROW_LABELS, floor=float(grid[0])))
    if extra is not None:
        print()
        print(_util_table(extra[0], extra[1], ROW_LABELS))
    return 0


def _simulate_run(args: argparse.Namespace) -> int:
    if args.model is not None:
        raise UsageError("--from-run takes its model from the run: drop --model")
    try:
        sc = load_run(
            args.from_run,
            layers=_int(args.layers, "--layers", 1) if args.layers is not None else None,
            step_time_s=_count(args.step_time, "--step-time")
            if args.step_time is not None
            else None,
            params=_count(args.params, "--params") if args.params is not None else None,
            latency_s=_nonneg(args.latency, "--latency") * 1e-3,
        )
    except RunError as exc:
        raise UsageError(str(exc)) from None
    targets, grid = _targets(args), _grid(args, (0.001, 1000.0, 74))
    res = simulate(sc.workload, sc.strategy, grid, sc.link)
    points = []
    if sc.per_worker_gbps is not None:
        points.append(sc.per_worker_gbps)
    if args.bandwidths is not None:
        points += _floats(args.bandwidths, "--bandwidths")
    if any(b <= 0 for b in points):
        raise UsageError(f"--bandwidths must be positive, got '{args.bandwidths}'")
    at = simulate(sc.workload, sc.strategy, points, sc.link).utilization.tolist() if points else []
    s = sc.strategy
    run_info = {
        "dir": str(sc.path),
        "strategy": sc.strategy_name,
        "workers": sc.link.workers,
        "params": sc.workload.params,
        "n_layers": sc.workload.layers,
        "step_compute_s": sc.workload.step_time_s,
        "sync_every": s.sync_every,
        "fragments": s.fragments,
        "overlap": s.overlap,
        "wire_bits_per_param_per_sync": sc.wire_bits_per_param,
        "measured_bandwidth_gbps": sc.bandwidth_gbps,
        "topology": sc.topology,
        "per_worker_gbps": sc.per_worker_gbps,
        "measured_utilization": sc.measured_utilization,
        "predicted_utilization": None if sc.bandwidth_gbps is None else round(at[0], 4),
    }
    if args.json:
        print(
            json.dumps(
                {
                    "model": sc.workload.name,
                    "targets": targets,
                    "rows": {sc.strategy_name: [_json_num(v) for v in res.min_bandwidth(targets)]},
                    "run": run_info,
                    "utilization": {
                        "bandwidths_gbps": [float(f"{b:.6g}") for b in grid],
                        sc.strategy_name: [round(float(u), 4) for u in res.utilization],
                    },
                    **(
                        {
                            "predicted_at": {
                                "bandwidths_gbps": points,
                                sc.strategy_name: [round(u, 4) for u in at],
                            }
                        }
                        if points
                        else {}
                    ),
                }
            )
        )
        return 0
    _print_run(sc, res, targets, grid, points, at)
    return 0


def _print_run(sc, res, targets: list[float], grid, points: list[float], at: list[float]) -> None:
    """The text report of :func:`_simulate_run`."""
    s = sc.strategy
    print(
        f"run {sc.path}: {sc.strategy_name}, M = {sc.link.workers}, "
        f"{sc.workload.params:.4g} parameters, "
        f"{sc.workload.layers} layers, {sc.workload.step_time_s:.4g} s compute per step, "
        f"H = {s.sync_every}, {s.fragments} layer group(s), tau = {s.overlap}, "
        f"{sc.wire_bits_per_param:.3g} wire bits per parameter per sync"
    )
    meas = "unknown" if sc.measured_utilization is None else f"{sc.measured_utilization:.3f}"
    bw = (
        "not recorded"
        if sc.bandwidth_gbps is None
        else (
            f"{sc.bandwidth_gbps:.4g} Gbit/s"
            + (f" shared by {sc.link.workers} workers" if sc.topology == "shared" else "")
        )
    )
    print(
        f"measured compute utilization {meas} at bandwidth {bw}"
        + ("" if sc.bandwidth_gbps is None else f"; predicted {at[0]:.3f}")
    )
    for b, u in zip(
        points[1 if sc.bandwidth_gbps is not None else 0 :],
        at[1 if sc.bandwidth_gbps is not None else 0 :],
    ):
        print(f"predicted compute utilization at {b:g} Gbit/s: {u:.3f}")
    print(
        f"\nGbit/s to reach each utilization ({grid.size}-point log grid "
        f"{grid[0]:.4g}..{grid[-1]:.4g}, '-' = none)"
    )
    print(_table({sc.strategy_name: res.min_bandwidth(targets)}, targets, {}, floor=float(grid[0])))


def run(args: argparse.Namespace) -> int:
    """Run `lowcomm simulate`; bad input prints one line to stderr and returns 2."""
    try:
        if getattr(args, "from_run", None):
            return _simulate_run(args)
        return _simulate_model(args)
    except (UsageError, ValueError) as exc:
        print(f"lowcomm simulate: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry (``python -m lowcomm.lab.sim``) until the lead's CLI wires it."""
    parser = argparse.ArgumentParser(prog="lowcomm simulate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
