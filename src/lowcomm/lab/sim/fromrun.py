"""Turn a measured run's summary.json into a simulator scenario (``lowcomm simulate --from-run``).

The run gives the step time, the layer count, the parameter count and the bytes it actually put
on the wire; the simulator then predicts its compute utilization at other bandwidths. Fields
(docs/design.md): params, inner_steps, strategy, workers, config{sync_every, fragments,
blocks_per_fragment, fragment_pattern, overlap}, bytes_sent_per_worker (wire) or
payload_bytes_per_worker, n_layers, step_compute_s (else compute_s / inner_steps), wall_s,
compute_s, compute_utilization.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowcomm import strategies
from lowcomm.train.summary import RunSummary

from .model import Link, Strategy, Workload

# Keys where a run may record the bandwidth of its shaped link, with their unit in Gbit/s.
_BANDWIDTH_KEYS = {
    "bandwidth_gbps": 1.0,
    "bandwidth_gbit": 1.0,
    "bandwidth_mbps": 1e-3,
    "bandwidth_mbit": 1e-3,
    "bandwidth_kbit": 1e-6,
}
_RATE_UNITS = {
    "bit": 1e-9,
    "kbit": 1e-6,
    "mbit": 1e-3,
    "gbit": 1.0,
    "tbit": 1e3,
    "bps": 1e-9,
    "kbps": 1e-6,
    "mbps": 1e-3,
    "gbps": 1.0,
}


class RunError(ValueError):
    """A run directory the simulator cannot use; the message says what is missing."""


@dataclass
class RunScenario:
    """What the simulator needs from one measured run, plus what was measured."""

    path: Path
    strategy_name: str
    workload: Workload
    strategy: Strategy
    link: Link
    measured_utilization: float | None
    """compute_s / wall_s of the run (None when the summary lacks both and compute_utilization)."""
    bandwidth_gbps: float | None
    """The shaped link's bandwidth if the summary records one (None: unshaped or unknown)."""
    topology: str
    """'shared' (all workers behind one shaped link, docs/benchmarking.md §2 "simple") or
    'per-worker'."""
    wire_bits_per_param: float
    """Bits each worker sent per parameter per sync, from the measured bytes."""
    syncs_per_param: float

    @property
    def per_worker_gbps(self) -> float | None:
        """The bandwidth each worker's traffic gets: a shared link is split M ways."""
        if self.bandwidth_gbps is None:
            return None
        return self.bandwidth_gbps / (self.link.workers if self.topology == "shared" else 1)


def parse_rate(value: Any) -> float | None:
    """'100mbit', '1gbit', '250Mbps' -> Gbit/s; a bare number is read as Mbit/s (tc's habit)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) * 1e-3 if value > 0 else None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z/]*)\s*", str(value))
    if not m:
        return None
    unit = m.group(2).lower().replace("/s", "ps") or "mbit"
    if unit not in _RATE_UNITS:
        return None
    rate = float(m.group(1)) * _RATE_UNITS[unit]
    return rate if rate > 0 else None


def _find_bandwidth(summary: RunSummary) -> float | None:
    top = {**summary.extra, "bandwidth": summary.bandwidth}
    for scope in (top, summary.config):
        for key, unit in _BANDWIDTH_KEYS.items():
            val = scope.get(key)
            if isinstance(val, (int, float)) and not isinstance(val, bool) and val > 0:
                return float(val) * unit
        if scope.get("bandwidth") is not None:
            rate = parse_rate(scope["bandwidth"])
            if rate is not None:
                return rate
    return None


def _number(val: Any) -> float | None:
    """``val`` as a float when it is a finite number, else None."""
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
        return None
    return float(val)


def _sends(inner_steps: int, sync_every: int, fragments: int) -> float:
    """Mean number of sends per fragment in 1..inner_steps under lowcomm.schedule's offsets."""
    total = 0
    for p in range(fragments):
        t_p = (p * sync_every) // fragments
        first = t_p if t_p >= 1 else sync_every
        total += 0 if first > inner_steps else (inner_steps - first) // sync_every + 1
    return total / fragments


def load_run(
    run_dir: str | Path,
    *,
    layers: int | None = None,
    step_time_s: float | None = None,
    params: float | None = None,
    latency_s: float = 0.0,
) -> RunScenario:
    """Read DIR/summary.json; explicit ``layers``/``step_time_s``/``params`` fill or override it."""
    path = Path(run_dir)
    file, summary = _read_summary(path)
    _check_fields(file, summary, layers, step_time_s, params)
    name = str(summary.strategy)
    method = strategies.find(name)
    if method is None or method.peer:
        ours = ", ".join(strategies.names(peers=False))
        raise RunError(f"{file}: unknown strategy '{name}' (expected one of {ours})")
    inner_steps, workers = int(summary.inner_steps), int(summary.workers)
    n_layers = int(layers if layers is not None else summary.n_layers)
    n_params = float(params if params is not None else summary.params)
    if step_time_s is None:
        step_time_s = _number(summary.step_compute_s)
        if step_time_s is None:
            step_time_s = float(summary.compute_s) / max(inner_steps, 1)
    if inner_steps < 1 or workers < 2 or n_layers < 1 or n_params <= 0 or step_time_s <= 0:
        raise RunError(
            f"{file}: need inner_steps >= 1, workers >= 2, n_layers >= 1, params > 0 "
            f"and a positive step time (got {inner_steps}, {workers}, {n_layers}, "
            f"{n_params:g}, {step_time_s:g})"
        )
    strategy, wire_bits, sends = _strategy(file, summary, name, n_layers, n_params, workers)
    measured = _number(summary.compute_utilization)
    wall, compute = _number(summary.wall_s), _number(summary.compute_s)
    if measured is None and wall and compute is not None:
        measured = compute / wall
    workload = Workload(
        params=n_params, layers=n_layers, step_time_s=step_time_s, name=f"run:{path}"
    )
    topology = str(summary.topology or summary.config.get("topology") or "per-worker")
    if topology not in ("shared", "per-worker"):
        raise RunError(f"{file}: unknown topology '{topology}' (expected shared or per-worker)")
    return RunScenario(
        path,
        name,
        workload,
        strategy,
        Link(workers, latency_s),
        measured,
        _find_bandwidth(summary),
        topology,
        wire_bits,
        sends,
    )


def _read_summary(path: Path) -> tuple[Path, RunSummary]:
    """The summary file of a run folder (or the file itself) and its parsed contents."""
    if not path.exists():
        raise RunError(f"run directory {path} does not exist")
    file = path / "summary.json" if path.is_dir() else path
    if not file.is_file():
        raise RunError(f"{path} has no summary.json (is it a `lowcomm train --out` directory?)")
    try:
        return file, RunSummary.read(file)
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise RunError(f"cannot read {file}: {exc}") from None


def _check_fields(
    file: Path, s: RunSummary, layers: int | None, step_time_s: float | None, params: float | None
) -> None:
    """RunError naming every field the scenario needs and neither the file nor a flag gives."""
    missing = [k for k in ("strategy", "inner_steps", "workers") if getattr(s, k) is None]
    if params is None and _number(s.params) is None:
        missing.append("params")
    if layers is None and s.n_layers is None:
        missing.append("n_layers (or pass --layers)")
    if step_time_s is None and _number(s.step_compute_s) is None and _number(s.compute_s) is None:
        missing.append("step_compute_s or compute_s (or pass --step-time)")
    if _number(s.bytes_sent_per_worker) is None and _number(s.payload_bytes_per_worker) is None:
        missing.append("bytes_sent_per_worker or payload_bytes_per_worker")
    if missing:
        raise RunError(f"{file} lacks {', '.join(missing)}")


def _strategy(
    file: Path, summary: RunSummary, name: str, n_layers: int, n_params: float, workers: int
) -> tuple[Strategy, float, float]:
    """The simulator's strategy for the run, its wire bits per parameter per send, and sends."""
    config = summary.config
    method = strategies.get(name)
    if method.per_step:
        sync_every, overlap, groups, pattern = 1, 0, 1, "strided"
    else:
        sync_every = int(config.get("sync_every") or 1)
        overlap = int(config.get("overlap") or 0)
        if overlap == -1:  # the engine's "a whole round" (CO2): tau = H
            overlap = sync_every
        pattern = str(config.get("fragment_pattern") or "strided")
        bpf = int(config.get("blocks_per_fragment") or 0)
        frags = int(config.get("fragments") or 1)
        # lowcomm counts the embeddings fragment in P; the simulator groups layers only.
        groups = -(-n_layers // bpf) if bpf > 0 else (frags - 1 if frags >= 2 else 1)
        groups = max(1, min(groups, n_layers))
    sends = _sends(int(summary.inner_steps), sync_every, groups)
    if sends <= 0:
        raise RunError(
            f"{file}: the run made no sync in {summary.inner_steps} steps with H = {sync_every}"
        )
    sent = _number(summary.bytes_sent_per_worker)
    if sent is not None:
        wire_bits = 8.0 * sent / (n_params * sends)
        strategy = Strategy(name, sync_every, groups, pattern, overlap, wire_bits, "wire")
        return strategy, wire_bits, sends
    payload_bits = 8.0 * float(summary.payload_bytes_per_worker) / (n_params * sends)
    collective = "allgather" if method.sends_selection else "allreduce"
    strategy = Strategy(name, sync_every, groups, pattern, overlap, payload_bits, collective)
    return strategy, strategy.wire_bits_per_param(workers), sends
