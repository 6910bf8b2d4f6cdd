"""Write benchmarks/simulator.md: ``python -m lowcomm.lab.sim.report > benchmarks/simulator.md``.

The prose lives in report_template.md next to this module, with named ``{placeholders}``; this
module computes the numbers and tables and fills them in.

The published tables below are reference data for the comparison only; the model never reads
them (lowcomm.lab.sim.model derives every number from parameters, layers, step time and bits).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
from importlib import resources

import numpy as np

from .model import (
    GRID,
    PAPER_WIRE_SCALE,
    PRESETS,
    ROW_LABELS,
    TARGETS,
    Link,
    make_strategies,
    min_bandwidth_table,
    simulate,
)

# Streaming DiLoCo (Douillard et al., 2025), Table 4: first grid Gbit/s reaching 50..99% CU.
PAPER_TABLE4: dict[str, dict[str, list[float]]] = {
    "1b": {
        "dp": [86.8, 152.6, 184.2, 222.3, 569.0],
        "diloco": [1.4, 6.2, 13.3, 23.3, 86.8],
        "streaming": [1.4, 5.2, 9.1, 16.0, 28.1],
        "streaming_overlap": [1.4, 4.3, 6.2, 9.1, 11.0],
        "streaming_overlap_fp4": [0.4, 0.9, 1.7, 2.0, 3.0],
    },
    "10b": {
        "dp": [104.8, 222.3, 222.3, 268.3, 471.5],
        "diloco": [1.7, 7.5, 16.0, 33.9, 104.8],
        "streaming": [1.7, 5.2, 9.1, 13.3, 19.3],
        "streaming_overlap": [1.7, 3.6, 5.2, 6.2, 7.5],
        "streaming_overlap_fp4": [0.4, 0.9, 1.4, 1.4, 1.7],
    },
    "100b": {
        "dp": [184.2, 323.8, 390.7, 390.7, 471.5],
        "diloco": [3.0, 11.0, 23.3, 49.4, 184.2],
        "streaming": [2.4, 6.2, 9.1, 11.0, 19.3],
        "streaming_overlap": [1.7, 3.6, 4.3, 5.2, 5.2],
        "streaming_overlap_fp4": [0.5, 0.9, 1.1, 1.1, 1.4],
    },
}


def _pos(x: float | None) -> int | None:
    """Index of the grid point nearest to x (log scale)."""
    return None if x is None else int(np.argmin(np.abs(np.log(GRID) - np.log(x))))


def _f(x: float | None) -> str:
    """A bandwidth cell: 3 significant digits below 10, one decimal above, – for None."""
    return "–" if x is None else (f"{x:.3g}" if x < 10 else f"{x:.1f}")


def _tables(scale: float) -> dict[str, dict[str, list[float | None]]]:
    """Minimum bandwidth per preset, method and target at this wire scale."""
    out = {}
    for name, p in PRESETS.items():
        out[name] = min_bandwidth_table(
            p.workload,
            make_strategies(
                p.workload, sync_every=p.sync_every, blocks_per_fragment=p.blocks_per_fragment
            ),
            Link(p.workers, wire_scale=scale),
        )
    return out


def _target_table(first: str, rows: list[str]) -> str:
    """A markdown table with one column per utilization target."""
    head = f"| {first} | " + " | ".join(f"{t:.0%}" for t in TARGETS) + " |"
    return "\n".join([head, "|---" * (len(TARGETS) + 1) + "|", *rows])


def _planner_rows(phys: dict[str, dict[str, list[float | None]]]) -> str:
    """Rows of the planner's 95% table: bandwidth and average traffic per size."""
    lines = []
    for key, label in ROW_LABELS.items():
        cells = []
        for name, p in PRESETS.items():
            strat = make_strategies(p.workload)[key]
            res = simulate(p.workload, strat, [1.0], Link(p.workers))
            avg = res.wire_bytes_per_step * 8 / 1e9 / p.workload.step_time_s
            cells += [_f(phys[name][key][3]), f"{avg:.3g}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_LATENCY_KEYS = ("dp", "diloco", "streaming_overlap_fp4", "sparseloco", "co2")
_LATENCY_LINKS = (
    ("M = 2, 0 ms", Link(2)),
    ("M = 2, 10 ms one way", Link(2, 0.010)),
    ("M = 2, 50 ms one way", Link(2, 0.050)),
    ("M = 4, 0 ms", Link(4)),
    ("M = 8, 0 ms", Link(8)),
)


def _latency_table() -> str:
    """The 1B table at 95%: latency and worker count against a few methods."""
    p = PRESETS["1b"]
    strats = {k: v for k, v in make_strategies(p.workload).items() if k in _LATENCY_KEYS}
    lines = [
        "| setting | " + " | ".join(ROW_LABELS[k] for k in _LATENCY_KEYS) + " |",
        "|---" * (len(_LATENCY_KEYS) + 1) + "|",
    ]
    for label, link in _LATENCY_LINKS:
        rows = min_bandwidth_table(p.workload, strats, link)
        lines.append(f"| {label} | " + " | ".join(_f(v[3]) for v in rows.values()) + " |")
    return "\n".join(lines)


def _table4(
    phys: dict[str, dict[str, list[float | None]]], fitted: dict[str, dict[str, list[float | None]]]
) -> dict[str, str]:
    """Paper-vs-ours tables per size, plus the grid-offset histogram lines."""
    fields: dict[str, str] = {}
    counts: dict[float, list[int]] = {1.0: [], PAPER_WIRE_SCALE: []}
    for name, table in PAPER_TABLE4.items():
        pr = PRESETS[name]
        fields[f"layers_{name}"] = str(pr.workload.layers)
        fields[f"step_{name}"] = f"{pr.workload.step_time_s:g}"
        rows = []
        for key, paper in table.items():
            cells = []
            for j, pv in enumerate(paper):
                a, b = phys[name][key][j], fitted[name][key][j]
                da, db = _pos(a) - _pos(pv), _pos(b) - _pos(pv)
                counts[1.0].append(da)
                counts[PAPER_WIRE_SCALE].append(db)
                cells.append(f"{pv:.1f} / {_f(a)} ({da:+d}) / {_f(b)} ({db:+d})")
            rows.append(f"| {ROW_LABELS[key]} | " + " | ".join(cells) + " |")
        fields[f"table4_{name}"] = _target_table("method", rows)
    lines = []
    for scale, ds in counts.items():
        hist = {d: ds.count(d) for d in sorted(set(ds))}
        lines.append(
            f"- wire scale {scale:g}: offsets over 75 cells {hist}; 1B only: "
            f"{ {d: ds[:25].count(d) for d in sorted(set(ds[:25]))} }"
        )
    fields["offsets"] = "\n".join(lines)
    return fields


def _table1_hours() -> dict[str, str]:
    """Predicted hours for the paper's Table 1 (1B at 1 Gbit/s, 0.67 h unconstrained)."""
    p = PRESETS["1b"]
    strats = make_strategies(p.workload)
    dp = simulate(p.workload, strats["dp"], [1.0]).utilization[0]
    dp_paper = simulate(
        p.workload, strats["dp"], [1.0], Link(2, wire_scale=PAPER_WIRE_SCALE)
    ).utilization[0]
    fp4 = simulate(p.workload, strats["streaming_overlap_fp4"], [1.0]).utilization[0]
    return {
        "dp_hours": f"{0.67 / dp:.0f}",
        "dp_hours_paper_scale": f"{0.67 / dp_paper:.0f}",
        "fp4_hours": f"{0.67 / fp4:.2f}",
    }


def _template() -> str:
    """The report's prose with named placeholders, installed next to this module."""
    return (resources.files("lowcomm.lab.sim") / "report_template.md").read_text(encoding="utf-8")


def render() -> str:
    """The whole report as markdown text."""
    phys, fitted = _tables(1.0), _tables(PAPER_WIRE_SCALE)
    fields = {
        "cpu_count": str(os.cpu_count()),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "system": platform.system(),
        "arch": platform.machine(),
        "date": _dt.date.today().isoformat(),
        "planner_rows": _planner_rows(phys),
        "latency_table": _latency_table(),
        **_table4(phys, fitted),
        **_table1_hours(),
    }
    for name in ("10b", "100b"):
        fields[f"full_{name}"] = _target_table(
            "method",
            [
                f"| {ROW_LABELS[k]} | " + " | ".join(_f(v) for v in vals) + " |"
                for k, vals in phys[name].items()
            ],
        )
    return _template().format_map(fields)


def main() -> None:
    """Print the report (benchmarks/simulator.md) to stdout."""
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
    sys.stdout.flush()
