"""Compute-utilization simulator: what bandwidth does a run need? (numpy only, no torch).

    >>> from lowcomm.lab.sim import PRESETS, make_strategies, min_bandwidth_table, Link
    >>> p = PRESETS["1b"]
    >>> table = min_bandwidth_table(p.workload, make_strategies(p.workload), Link(p.workers))
    >>> round(table["dp"][3], 1)   # Gbit/s for 95% compute utilization with data-parallel
    268.3

See :mod:`lowcomm.lab.sim.model` for the model and its calibration, :mod:`lowcomm.lab.sim.cli` for
`lowcomm simulate`, and benchmarks/simulator.md for the tables.
"""

from .fromrun import RunError, RunScenario, load_run
from .model import (
    GRID,
    PAPER_WIRE_SCALE,
    PRESETS,
    ROW_LABELS,
    TARGETS,
    Link,
    Preset,
    SimResult,
    Strategy,
    Workload,
    bandwidth_grid,
    layer_groups,
    make_strategies,
    min_bandwidth,
    min_bandwidth_table,
    simulate,
)

__all__ = [
    "GRID",
    "PAPER_WIRE_SCALE",
    "PRESETS",
    "ROW_LABELS",
    "TARGETS",
    "Link",
    "Preset",
    "RunError",
    "RunScenario",
    "SimResult",
    "Strategy",
    "Workload",
    "bandwidth_grid",
    "layer_groups",
    "load_run",
    "make_strategies",
    "min_bandwidth",
    "min_bandwidth_table",
    "simulate",
]
