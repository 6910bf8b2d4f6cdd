"""Compute-utilization model of low-communication training (docs/benchmarking.md §4).

A per-step dependency model in the spirit of the Streaming DiLoCo paper's simulation
(Douillard et al., 2025): one worker's accelerator runs, per transformer layer, a forward, a
backward for the activations and a backward for the parameters; every reduction goes on one
FIFO link shared by all layers; a layer's next forward waits for the reduction it needs.

Time line of one inner step on one worker (L layers, step time S, forward = S/3):

    compute: F_0 F_1 ... F_{L-1} | B_{L-1} B_{L-2} ... B_0          (B_l = dA_l then dW_l)
    link:                            R_{L-1} R_{L-2} ...  (FIFO, each starts after its dW_l)

A reduction started at inner step t is needed by the forward of that layer at step t + 1 + tau:
tau = 0 blocks the next step (data-parallel, DiLoCo, SparseLoCo, streaming without overlap),
tau = 1 lets the transfer overlap one more inner step (Streaming DiLoCo's overlap), tau = H is
CO2's whole-round overlap. So data-parallel reductions overlap the backward layer by layer, and
the outer gradients of DiLoCo-style methods overlap the backward of their sync step too (the
paper's simulator makes the same choice).

The link carries ``wire_bits / bandwidth + hops * latency`` per reduction, with the standard ring
costs per worker: all-reduce 2(M-1)/M of the buffer in 2(M-1) hops, all-gather (M-1) x the
payload in M-1 hops. Utilization = ideal compute time / simulated wall time, in steady state.

Everything is vectorised over the bandwidth grid; numpy and the standard library only (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

TARGETS: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95, 0.99)
"""Compute-utilization targets of the paper's table."""

ROW_LABELS: dict[str, str] = {
    "dp": "data-parallel",
    "diloco": "DiLoCo",
    "streaming": "streaming",
    "streaming_overlap": "streaming + overlap",
    "streaming_overlap_fp4": "streaming + overlap + FP4",
    "sparseloco": "SparseLoCo",
    "co2": "CO2",
    "loco": "LoCo (4-bit DP)",
}
"""Row name -> human label, in the order tables print them."""

COLLECTIVES = ("allreduce", "allgather", "wire")


def bandwidth_grid(lo_gbps: float = 0.1, hi_gbps: float = 1000.0, points: int = 50) -> np.ndarray:
    """Log-spaced bandwidths in Gbit/s; the default is the paper's numpy.logspace(-1, 3, 50)."""
    if not (lo_gbps > 0 and hi_gbps > lo_gbps and points >= 2):
        raise ValueError(
            f"bad bandwidth grid: {lo_gbps}..{hi_gbps} Gbit/s with {points} points "
            f"(need 0 < min < max and at least 2 points)"
        )
    return np.logspace(math.log10(lo_gbps), math.log10(hi_gbps), int(points))


GRID: np.ndarray = bandwidth_grid()
"""The paper's grid: 50 log-spaced points from 0.1 to 1000 Gbit/s."""


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """What one worker (replica group) computes per inner step."""

    params: float
    """N: parameters of the model, spread evenly over the layers."""
    layers: int
    """L: transformer layers; each is one forward, one backward and one reduction in the model."""
    step_time_s: float
    """S: seconds of pure compute per inner step (forward + backward) at the worker's speed."""
    name: str = "custom"
    """Label used in tables and JSON."""
    forward_fraction: float = 1.0 / 3.0
    """Share of S spent in the forward; the backward (activations + parameters) takes the rest."""

    def __post_init__(self) -> None:
        _positive("params", self.params)
        _positive("step_time_s", self.step_time_s)
        if not (isinstance(self.layers, int) and self.layers >= 1):
            raise ValueError(f"layers must be a positive integer, got {self.layers!r}")
        if not 0.0 < self.forward_fraction < 1.0:
            raise ValueError(f"forward_fraction must be in (0, 1), got {self.forward_fraction!r}")

    @classmethod
    def from_flops(
        cls,
        params: float,
        layers: int,
        flops_per_step: float,
        chips: float,
        peak_flops: float,
        mfu: float,
        name: str = "custom",
    ) -> Workload:
        """Step time = FLOPs per step / (chips x peak FLOP/s x MFU); FLOPs ~ 6 x N x tokens/step."""
        for key, val in (
            ("flops_per_step", flops_per_step),
            ("chips", chips),
            ("peak_flops", peak_flops),
            ("mfu", mfu),
        ):
            _positive(key, val)
        if mfu > 1:
            raise ValueError(f"mfu is a fraction in (0, 1], got {mfu}")
        return cls(
            params=params,
            layers=layers,
            name=name,
            step_time_s=flops_per_step / (chips * peak_flops * mfu),
        )


@dataclass(frozen=True)
class Link:
    """The slow link between workers: one FIFO per worker, shared by all reductions."""

    workers: int = 2
    """M: workers (replica groups) taking part in each reduction."""
    latency_s: float = 0.0
    """One-way latency per hop of a collective, seconds (the paper's table uses 0)."""
    wire_scale: float = 1.0
    """Multiplies the wire bits of every reduction. 1 is the ring accounting of this module
    (what really crosses the link); PAPER_WIRE_SCALE reproduces the paper's simulated table
    (see there)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.workers, int) and self.workers >= 2):
            raise ValueError(f"workers must be an integer >= 2, got {self.workers!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency must be >= 0 seconds, got {self.latency_s!r}")
        if not (math.isfinite(self.wire_scale) and self.wire_scale > 0):
            raise ValueError(f"wire_scale must be > 0, got {self.wire_scale!r}")


PAPER_WIRE_SCALE = 0.84
"""The one constant that makes this model match the Streaming DiLoCo paper's simulated table.

With the physical accounting (wire_scale = 1: bf16 = 16 bits per parameter, ring all-reduce
2(M-1)/M) the cells of the paper's Table 4 (1B, 10B, 100B; 75 cells) come out on the paper's
grid point or one point (about 20%) higher (61 cells), one cell two points higher (100B,
streaming + overlap, 50%). Scaling every transfer by 0.84 puts 67 of 75 cells on the paper's
grid point and the other 8 one point away (benchmarks/simulator.md has both tables). The paper's own
Table 1 (1B, Dolma: 109 h for data-parallel at 1 Gbit/s against 0.67 h unconstrained) agrees
instead with the physical accounting (107 h here, 90 h with 0.84), so the paper's simulator
seems to count about 16% fewer bits per transfer than its text says. We keep 1 as the default
(a planner should be conservative) and offer this value to compare with the paper.
"""


@dataclass(frozen=True)
class Strategy:
    """One row of the table: what is reduced, how often, in how many pieces, how late."""

    name: str
    """Row key (``dp``, ``diloco``, ``streaming``, ...)."""
    sync_every: int = 1
    """H: inner steps between two reductions of the same layer (1 = every step)."""
    fragments: int = 1
    """Groups of layers reduced at different steps; group p is sent at steps t_p + kH with
    t_p = floor(p H / fragments), as lowcomm.schedule does for the block fragments."""
    pattern: str = "strided"
    """Layer -> group: strided (layer l in group l mod P) or sequential (consecutive runs)."""
    overlap: int = 0
    """tau: inner steps a reduction may stay in flight (0 = blocks the next step)."""
    bits_per_param: float = 16.0
    """Payload bits per parameter (bf16 = 16, FP4 = 4, top-k = density x (index + value bits))."""
    collective: str = "allreduce"
    """allreduce (ring: 2(M-1)/M of the buffer), allgather ((M-1) x the payload), or wire
    (bits_per_param already counts wire bits per worker, e.g. measured by a run)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.sync_every, int) and self.sync_every >= 1):
            raise ValueError(f"sync_every must be an integer >= 1, got {self.sync_every!r}")
        if not (isinstance(self.fragments, int) and self.fragments >= 1):
            raise ValueError(f"fragments must be an integer >= 1, got {self.fragments!r}")
        if self.pattern not in ("strided", "sequential"):
            raise ValueError(f"unknown pattern {self.pattern!r}: choose strided or sequential")
        if not (isinstance(self.overlap, int) and self.overlap >= 0):
            raise ValueError(f"overlap must be an integer >= 0, got {self.overlap!r}")
        if not (math.isfinite(self.bits_per_param) and self.bits_per_param >= 0):
            raise ValueError(f"bits_per_param must be >= 0, got {self.bits_per_param!r}")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"unknown collective {self.collective!r}: choose one of {COLLECTIVES}")

    def wire_bits_per_param(self, workers: int) -> float:
        """Bits each worker puts on its link per parameter per reduction."""
        if self.collective == "allreduce":
            return self.bits_per_param * 2.0 * (workers - 1) / workers
        if self.collective == "allgather":
            return self.bits_per_param * (workers - 1)
        return self.bits_per_param

    def hops(self, workers: int) -> int:
        """Sequential ring steps of one collective (each pays the link latency once)."""
        if self.collective == "allreduce":
            return 2 * (workers - 1)
        if self.collective == "allgather":
            return workers - 1
        return 1


def layer_groups(layers: int, fragments: int, pattern: str = "strided") -> list[list[int]]:
    """Split layers 0..L-1 into groups: the engine's own rule, so simulation and runs agree."""
    from lowcomm.schedule import assign_blocks

    return assign_blocks(layers, fragments, pattern)


def make_strategies(
    workload: Workload,
    *,
    sync_every: int = 100,
    blocks_per_fragment: int = 3,
    fragments: int | None = None,
    pattern: str = "strided",
    overlap: int = 1,
    dense_bits: float = 16.0,
    fp4_bits: float = 4.0,
    density: float = 1 / 64,
    index_bits: float = 12.0,
    value_bits: float = 2.0,
    loco_bits: float = 4.0,
    co2_sync_every: int | None = None,
) -> dict[str, Strategy]:
    """The table's rows for one workload.

    dp: bf16 gradients every step, ring all-reduce, overlapped with the backward.
    diloco: the whole model's outer gradient every H steps, blocking (tau = 0).
    streaming: one fragment of ``blocks_per_fragment`` layers at a time (P = ceil(L / blocks)),
    blocking; streaming_overlap: tau = ``overlap``; streaming_overlap_fp4: and 4-bit payloads.
    sparseloco: every H steps, density x (index + value) bits per parameter, all-gathered.
    co2: the whole model every H steps, overlapped with the whole next round (tau = H).
    loco: 4-bit gradients every step (reduce-scatter by all-to-all + all-gather ~ an all-reduce).
    """
    if fragments is None:
        if not (isinstance(blocks_per_fragment, int) and blocks_per_fragment >= 1):
            raise ValueError(
                f"blocks_per_fragment must be an integer >= 1, got {blocks_per_fragment!r}"
            )
        fragments = -(-workload.layers // blocks_per_fragment)
    fragments = min(fragments, workload.layers)
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    co2_h = sync_every if co2_sync_every is None else co2_sync_every
    stream = Strategy("streaming", sync_every, fragments, pattern, 0, dense_bits)
    return {
        "dp": Strategy("dp", 1, 1, "strided", 0, dense_bits),
        "diloco": Strategy("diloco", sync_every, 1, "strided", 0, dense_bits),
        "streaming": stream,
        "streaming_overlap": replace(stream, name="streaming_overlap", overlap=overlap),
        "streaming_overlap_fp4": replace(
            stream, name="streaming_overlap_fp4", overlap=overlap, bits_per_param=fp4_bits
        ),
        "sparseloco": Strategy(
            "sparseloco",
            sync_every,
            1,
            "strided",
            0,
            density * (index_bits + value_bits),
            "allgather",
        ),
        "co2": Strategy("co2", co2_h, 1, "strided", co2_h, dense_bits),
        "loco": Strategy("loco", 1, 1, "strided", 0, loco_bits),
    }


@dataclass
class SimResult:
    """Steady-state outcome of one strategy over a set of bandwidths."""

    workload: Workload
    strategy: Strategy
    link: Link
    bandwidth_gbps: np.ndarray
    """The bandwidths simulated, Gbit/s per worker link."""
    utilization: np.ndarray
    """Ideal compute time / wall time at each bandwidth, in (0, 1]."""
    wall_per_step_s: np.ndarray = field(repr=False)
    """Mean wall-clock seconds per inner step at each bandwidth."""
    wire_bytes_per_step: float = 0.0
    """Mean wire bytes each worker sends per inner step (independent of the bandwidth)."""

    def min_bandwidth(self, targets: Sequence[float] = TARGETS) -> list[float | None]:
        """The first bandwidth reaching each target (None where none does)."""
        return min_bandwidth(self.utilization, self.bandwidth_gbps, targets)


def min_bandwidth(
    utilization: np.ndarray, grid: np.ndarray, targets: Sequence[float] = TARGETS
) -> list[float | None]:
    """For each target, the smallest grid bandwidth whose utilization reaches it, or None.

    The first grid point at or above the target (the paper's convention); utilization rises
    with bandwidth, so this is also the threshold.
    """
    out: list[float | None] = []
    for target in targets:
        hit = np.nonzero(utilization >= target - 1e-12)[0]
        out.append(float(grid[hit[0]]) if len(hit) else None)
    return out


def simulate(
    workload: Workload,
    strategy: Strategy,
    bandwidth_gbps: Iterable[float] | float = GRID,
    link: Link = Link(),
    periods: int = 2,
    warmup_periods: int = 2,
) -> SimResult:
    """Simulate ``warmup_periods`` + ``periods`` sync periods and measure the last ``periods``.

    A period is H inner steps (at least 4 steps when H is small) so that every group syncs the
    same number of times in the measured window; the warm-up lets the link's backlog settle.
    """
    if not (
        isinstance(periods, int)
        and periods >= 1
        and isinstance(warmup_periods, int)
        and warmup_periods >= 0
    ):
        raise ValueError("periods must be >= 1 and warmup_periods >= 0 (integers)")
    bw = np.atleast_1d(np.asarray(bandwidth_gbps, dtype=float))
    if bw.ndim != 1 or not np.all(np.isfinite(bw)) or np.any(bw <= 0):
        raise ValueError("bandwidths must be positive finite Gbit/s values")
    L, S, H = workload.layers, workload.step_time_s, strategy.sync_every
    P = min(strategy.fragments, L)
    groups = layer_groups(L, P, strategy.pattern)
    offsets = [(p * H) // P for p in range(P)]
    # Which layers are sent after global inner step k (1-based, as lowcomm.schedule counts).
    send_at: dict[int, list[int]] = {}
    for p, grp in enumerate(groups):
        send_at.setdefault(offsets[p] % H, []).extend(grp)
    for key in send_at:
        send_at[key].sort(reverse=True)  # backward order: the last layer finishes first

    f = S * workload.forward_fraction / L  # forward of one layer
    b = S * (1.0 - workload.forward_fraction) / L  # backward of one layer: dA then dW
    wire_bits_layer = (
        workload.params / L * strategy.wire_bits_per_param(link.workers) * link.wire_scale
    )
    cost = wire_bits_layer / (bw * 1e9) + strategy.hops(link.workers) * link.latency_s
    tau = strategy.overlap

    period = H if H >= 4 else 4 * H
    warm, measured = warmup_periods * period, periods * period
    fwd_tail = (L - np.arange(L))[:, None] * f  # ready_l + (L - l) f bounds the forward's end
    ready = np.zeros((L, bw.size))
    pending: dict[int, list[tuple[int, np.ndarray]]] = {}
    t = np.zeros(bw.size)
    linkfree = np.zeros(bw.size)
    t_start = t
    for k in range(1, warm + measured + 1):
        if k == warm + 1:
            t_start = t.copy()
        arrivals = pending.pop(k, ())
        for layer, finish in arrivals:
            ready[layer] = np.maximum(ready[layer], finish)
        # forward: F_l starts after F_{l-1} and after the reduction layer l waits for
        t_fwd = np.maximum(t + L * f, np.max(ready + fwd_tail, axis=0))
        # backward: layer l's parameter gradient is done (L - l) layer-backwards after t_fwd
        if k % H in send_at:
            for layer in send_at[k % H]:
                grad_done = t_fwd + (L - layer) * b
                linkfree = np.maximum(linkfree, grad_done) + cost
                pending.setdefault(k + 1 + tau, []).append((layer, linkfree.copy()))
        t = t_fwd + L * b
    wall = (t - t_start) / measured
    sends_per_step = sum(len(g) for g in groups) / (L * H)
    return SimResult(
        workload,
        strategy,
        link,
        bw,
        np.minimum(1.0, S / wall),
        wall,
        wire_bits_layer * L * sends_per_step / 8.0,
    )


def min_bandwidth_table(
    workload: Workload,
    strategies: Mapping[str, Strategy] | None = None,
    link: Link = Link(),
    targets: Sequence[float] = TARGETS,
    grid: np.ndarray | None = None,
) -> dict[str, list[float | None]]:
    """Row -> the first grid bandwidth (Gbit/s) reaching each target, None where none does."""
    grid = GRID if grid is None else grid
    strategies = make_strategies(workload) if strategies is None else strategies
    return {
        name: simulate(workload, strat, grid, link).min_bandwidth(targets)
        for name, strat in strategies.items()
    }


@dataclass(frozen=True)
class Preset:
    """A model size of the Streaming DiLoCo paper's simulation, with its run settings."""

    workload: Workload
    workers: int = 2
    sync_every: int = 100
    blocks_per_fragment: int = 3


PRESETS: dict[str, Preset] = {
    "1b": Preset(Workload(params=1e9, layers=24, step_time_s=0.1, name="1b")),
    "10b": Preset(Workload(params=1e10, layers=48, step_time_s=0.8, name="10b")),
    "100b": Preset(Workload(params=1e11, layers=108, step_time_s=4.9, name="100b")),
}
"""The paper's three simulated sizes: M = 2, H = 100, 3-layer fragments (8/16/36 fragments)."""
