"""The report of a comparison: the results table (results.md, results.json), seed and per-link
tables, and the plots of loss against tokens, bytes and time; ``lowcomm report`` over finished
runs from several folders. Reads run folders; starts nothing."""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lowcomm.train.summary import RunSummary, ddp_reference, fmt_bytes, results_table  # noqa: F401


def _write_json(results: list[RunSummary], path: Path) -> None:
    path.write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")


def provenance(command: str | None = None) -> str:
    """One line naming what produced a table or plot: the command, the commit and the date."""
    from lowcomm.provenance import git_rev

    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = command if command is not None else "lowcomm " + " ".join(sys.argv[1:])
    return f"`{cmd}` · commit {git_rev()} · {when}"


def _write_results_md(out_dir: Path, body: str, command: str | None) -> None:
    """results.md: a provenance line (command, commit, date), then the tables."""
    (out_dir / "results.md").write_text(f"Produced by {provenance(command)}\n\n{body}\n")


def commands_list(results: list[RunSummary]) -> str:
    """A section naming, per row, the command that reruns it with every setting spelled out."""
    lines = [f"- {r.label}: `{c}`" for r in results if (c := r.command())]
    if not lines:
        return ""
    return "\n\nEach row's run, every default resolved (it gives that row's loss):\n\n" + "\n".join(
        lines
    )


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_results(results: list[RunSummary], out_dir: Path, subtitle: str = "") -> list[Path]:
    """PNG plots of validation loss vs tokens, vs wire bytes sent, vs wall-clock.

    ``subtitle`` (the command, commit and date) is printed under each plot's title.
    """
    if not results:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_spec = [
        ("tokens", "tokens trained", "loss_vs_tokens.png", False),
        ("bytes_sent", "wire bytes sent per worker", "loss_vs_bytes.png", True),
        ("wall_s", "wall-clock seconds (training loop)", "loss_vs_wallclock.png", False),
    ]
    written = [_loss_plot(plt, results, out_dir, spec, subtitle) for spec in axes_spec]
    swept = sorted({r.bandwidth for r in results if r.bandwidth}, key=_rate)
    if len(swept) > 1:  # a --bandwidths sweep: compute utilization per entry vs link rate
        written.append(_utilization_plot(plt, results, out_dir, subtitle))
    return written


def _entry(r: RunSummary) -> str:
    return r.entry or r.label


def _title(ax: Any, title: str, subtitle: str) -> None:
    """The title, with the provenance line wrapped so a long command stays inside the figure."""
    import textwrap

    lines = textwrap.wrap(subtitle.replace("`", ""), width=120, break_on_hyphens=False)
    ax.set_title("\n".join([title, *lines]), fontsize=8 if len(lines) < 3 else 6)


def _colours(plt: Any, entries: list[str]) -> dict[str, Any]:
    """One colour per entry, distinct up to 20 entries (the default cycle repeats after 10)."""
    if len(entries) <= 10:
        return {e: f"C{i}" for i, e in enumerate(entries)}
    cmap = plt.get_cmap("tab20")
    return {e: cmap(i % 20) for i, e in enumerate(entries)}


def _loss_plot(
    plt: Any, results: list[RunSummary], out_dir: Path, spec: tuple, subtitle: str
) -> Path:
    """One loss curve per run; one colour per entry, its seeds or links in other line styles."""
    key, label, fname, logx = spec
    entries = list(dict.fromkeys(_entry(r) for r in results))
    colours = _colours(plt, entries)
    seen: dict[str, int] = {}
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for r in results:
        style = ("-", "--", ":", "-.")[seen.get(_entry(r), 0) % 4]
        seen[_entry(r)] = seen.get(_entry(r), 0) + 1
        pts = _val_points(Path(r.run_dir or out_dir / r.label), key)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(
                xs, ys, style, marker="o", markersize=3, label=r.label, color=colours[_entry(r)]
            )
    ax.set_xlabel(label)
    ax.set_ylabel("validation loss (global parameters)")
    _title(ax, f"validation loss vs {label}", subtitle)
    if logx:
        ax.set_xscale("symlog", linthresh=1e3)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:  # runs without metrics draw no line
        ax.legend(fontsize=8 if len(entries) <= 8 else 6)
    fig.tight_layout()
    fig.savefig(out_dir / fname, dpi=110)
    plt.close(fig)
    return out_dir / fname


def _utilization_plot(plt: Any, results: list[RunSummary], out_dir: Path, subtitle: str) -> Path:
    """Compute utilization of each entry against the link rate of a bandwidth sweep."""
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for entry in dict.fromkeys(_entry(r) for r in results):
        pts = sorted(
            (_rate(r.bandwidth) / 1e6, r.compute_utilization)
            for r in results
            if _entry(r) == entry and r.bandwidth
        )
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=entry)
    ax.set_xscale("log")
    ax.set_xlabel("link rate per worker (Mbit/s)")
    ax.set_ylabel("compute utilization (compute / wall)")
    _title(ax, "compute utilization vs link rate", subtitle)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "utilization_vs_bandwidth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def collect_runs(paths: list[Path]) -> list[RunSummary]:
    """The summaries of finished runs under ``paths`` (run folders or `compare` output folders).

    Each summary gains ``run_dir``; its ``name`` is prefixed with the compare folder's name
    when runs come from more than one folder (e.g. a screen and a second-seed run).
    """
    found: list[tuple[Path, Path]] = []
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(
                f"{p}: no such folder (give run folders or `lowcomm compare --out` folders)"
            )
        if (p / "summary.json").exists():
            found.append((p.parent, p))
        else:
            found.extend((p, s.parent) for s in sorted(p.glob("*/summary.json")))
    if not found:
        raise FileNotFoundError(
            f"no finished runs (summary.json) under {', '.join(map(str, paths))}"
        )
    prefix = len({parent for parent, _ in found}) > 1
    results = []
    for parent, run in found:
        try:
            summary = RunSummary.read(run)
        except ValueError as e:  # JSONDecodeError included
            raise FileNotFoundError(
                f"{run / 'summary.json'} is not a valid summary ({e}): re-run that entry"
            ) from None
        summary.run_dir = str(run)
        entry = re.sub(r"-seed\d+$", "", summary.name or run.name)
        if summary.bandwidth and entry.endswith(f"-{summary.bandwidth}"):
            entry = entry[: -len(summary.bandwidth) - 1]
        summary.entry = summary.entry or entry
        if prefix:
            summary.name = f"{parent.name}/{summary.name or run.name}"
        results.append(summary)
    return results


def write_report(
    paths: list[Path], out_dir: Path, target_loss: float | None = None, command: str | None = None
) -> list[RunSummary]:
    """`lowcomm report`: one results table (results.md/json) and the plots for runs from
    many folders.

    With ``target_loss``, also the per-link table of :func:`network_table`.
    """
    results = collect_runs(paths)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(results, out_dir / "results.json")
    extra = "\n\n" + network_table(results, target_loss) if target_loss is not None else ""
    body = results_table(results) + "\n\n" + seeds_table(results) + extra
    _write_results_md(out_dir, body + commands_list(results), command)
    plot_results(results, out_dir, subtitle=provenance(command))
    return results


def seed_groups(results: list[RunSummary]) -> dict[str, list[RunSummary]]:
    """Runs grouped as repeats of one configuration: same entry, config (but the seed) and data.

    Runs of one entry name that differ in anything else form separate groups, labelled
    ``entry (2)``, ``entry (3)``... in the order they first appear.
    """
    by_key: dict[tuple[str, str], list[RunSummary]] = {}
    for r in results:
        by_key.setdefault((_entry(r), r.config_key()), []).append(r)
    groups: dict[str, list[RunSummary]] = {}
    for (entry, _), runs in by_key.items():
        label, n = entry, 1
        while label in groups:
            n += 1
            label = f"{entry} ({n})"
        groups[label] = runs
    return groups


def seeds_table(results: list[RunSummary]) -> str:
    """Markdown table per configuration over its seeds: mean final loss, spread, ratio to DDP."""
    lines = [
        "| entry | runs | mean final val loss | spread (max - min) | mean vs DDP | "
        "wire bytes sent / worker |",
        "|---|---|---|---|---|---|",
    ]
    for label, rs in seed_groups(results).items():
        losses = [r.final_val_loss for r in rs]
        mean = sum(losses) / len(losses)
        ddp = ddp_reference(results, rs[0])
        ratio = f"{mean / ddp:.3f}" if ddp else "-"
        sent = sum(r.bytes_sent_per_worker or 0 for r in rs) / len(rs)
        lines.append(
            f"| {label} | {len(rs)} | {mean:.4f} | {max(losses) - min(losses):.4f} | "
            f"{ratio} | {fmt_bytes(sent)} |"
        )
    return "\n".join(lines)


def time_to_loss(run_dir: Path, target: float) -> tuple[float, float] | None:
    """(training wall-clock seconds, inner step) at which validation loss first reaches ``target``.

    Linear interpolation between the two evaluations around the crossing; None if never reached.
    """
    prev: tuple[float, float, float] | None = None
    last: dict[str, Any] = {}
    for rec in _read_metrics(run_dir):
        last.update({k: v for k, v in rec.items() if k != "val_loss"})
        if "val_loss" not in rec or "wall_s" not in last:
            continue
        cur = (float(last["wall_s"]), float(last["step"]), float(rec["val_loss"]))
        if cur[2] <= target:
            if prev is None or prev[2] == cur[2]:
                return cur[0], cur[1]
            f = (prev[2] - target) / (prev[2] - cur[2])
            return prev[0] + f * (cur[0] - prev[0]), prev[1] + f * (cur[1] - prev[1])
        prev = cur
    return None


def network_table(results: list[RunSummary], target: float) -> str:
    """Markdown table per entry and link: utilization, tokens/s vs the unshaped run, time to
    ``target`` loss.

    A run too short to reach the target (DDP on the slowest links, docs/benchmarking.md §2) gets an
    estimate: the steps its unshaped run needed times its own measured seconds per step.
    """
    unshaped = {_entry(r): r for r in results if not r.bandwidth}
    lines = [
        f"| entry | link | compute util. | tokens/s | tokens/s vs unshaped | steps | "
        f"time to val loss {target} (s) | final val loss | wire bytes sent / worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        results, key=lambda r: (_entry(r), -_rate(r.bandwidth) if r.bandwidth else -math.inf)
    )
    for r in order:
        base = unshaped.get(_entry(r))
        tps = _tokens_per_s(r)
        rel = f"{tps / _tokens_per_s(base):.3f}" if base and (base.wall_s or 0) > 0 else "-"
        lines.append(
            f"| {_entry(r)} | {r.bandwidth or 'unshaped'} | "
            f"{r.compute_utilization or 0:.1%} | {tps:,.0f} | {rel} | {r.inner_steps} | "
            f"{_time_to_target(r, base, target)} | {r.final_val_loss:.4f} | "
            f"{fmt_bytes(r.bytes_sent_per_worker or 0)} |"
        )
    return "\n".join(lines)


def _tokens_per_s(r: RunSummary) -> float:
    return (r.tokens or 0) / r.wall_s if (r.wall_s or 0) > 0 else math.nan


def _time_to_target(r: RunSummary, base: RunSummary | None, target: float) -> str:
    """Seconds to ``target``; else estimated from the unshaped run's steps; else 'not reached'."""
    hit = time_to_loss(Path(r.run_dir), target) if r.run_dir else None
    if hit is not None:
        return f"{hit[0]:.0f}"
    base_hit = time_to_loss(Path(base.run_dir), target) if base and base.run_dir else None
    if base_hit and r.inner_steps:
        return f"≈ {base_hit[1] * (r.wall_s or 0) / r.inner_steps:.0f} (est.)"
    return "not reached"


def _rate(bandwidth: str) -> float:
    from ..netshape import parse_rate

    return float(parse_rate(bandwidth))


def _val_points(run_dir: Path, key: str) -> list[tuple[float, float]]:
    """(x, val_loss) pairs; x carried forward from the latest record that had it."""
    pts, last = [], {}
    for rec in _read_metrics(run_dir):
        last.update({k: v for k, v in rec.items() if k != "val_loss"})
        if "val_loss" in rec and key in last:
            pts.append((float(last[key]), float(rec["val_loss"])))
    return pts
