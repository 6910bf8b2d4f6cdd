"""`RunSummary`: the record every run writes as ``DIR/summary.json`` (fields in docs/design.md).

One typed record instead of string-keyed reads: the trainer builds it, ``compare``, ``report``
and the simulator's ``--from-run`` read it. Torch-free, so the simulator can import it.
Fields a summary may lack (written by an older version, or by hand) read as ``None``; keys this
class does not know are kept in ``extra`` and written back unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Settings that change how a run is observed or stored, not what it computes: runs differing
# only in these (or in the seed) are repeats of one configuration.
_BOOKKEEPING = frozenset(
    {
        "seed",
        "progress",
        "log",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "timeout_s",
        "threads",
        "device",
    }
)
# Settings that define the problem every strategy is compared on (model, data and budget).
_PROBLEM = ("model", "data", "shard", "steps", "batch_size", "seq_len")
# Left out of a reproducing command: how the run is shown (not what it computes), and a
# lighthouse address that belonged to that run's machine.
_NOT_REPRODUCED = frozenset({"progress", "log", "lighthouse"})


@dataclass
class RunSummary:
    """One finished run: what was trained, what it cost on the wire, and how the time split."""

    strategy: str | None = None
    name: str | None = None
    workers: int | None = None
    params: int | None = None
    n_layers: int | None = None
    vocab_size: int | None = None
    tokens: int | None = None
    inner_steps: int | None = None
    final_val_loss: float | None = None
    bytes_sent_per_worker: int | None = None
    bytes_received_per_worker: int | None = None
    payload_bytes_per_worker: int | None = None
    ddp_fp32_bytes_per_worker: int | None = None
    control_bytes_per_worker: int | None = None
    ranks_per_worker: int | None = None
    bytes_sent_per_rank: int | None = None
    """Wire bytes between workers sent by one rank (a worker of N ranks sends N times this)."""
    inner_bytes_sent_per_worker: int | None = None
    """FSDP2's traffic inside a worker (its ranks together); 0 with one rank per worker."""
    syncs: int | None = None
    peak_bytes_per_sync: int | None = None
    wall_s: float | None = None
    compute_s: float | None = None
    blocked_s: float | None = None
    compute_utilization: float | None = None
    step_compute_s: float | None = None
    peak_rss_bytes: int | None = None
    seed: int | None = None
    config: dict[str, Any] = field(default_factory=dict)
    data: str | None = None
    """One line describing the corpus the run trained on (source, token counts, split)."""
    torch_version: str | None = None
    git_rev: str | None = None
    device: str | None = None
    outer_clipped_elements: int | None = None
    outer_penalized_elements: int | None = None
    # set by `compare` / `report`
    entry: str | None = None
    """The `compare --strategies` item this run belongs to (its seeds and links share it)."""
    bandwidth: str | None = None
    topology: str | None = None
    measured_link_mbit: float | None = None
    run_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of the file this class does not name, kept so that a rewrite loses nothing."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSummary:
        """Build from a parsed summary.json; unknown keys go to ``extra``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        if not isinstance(known.get("config", {}), dict):
            raise ValueError("summary 'config' is not an object")
        known["config"] = dict(known.get("config") or {})
        # the command is derived from the rest (see `command`), never read back
        extra = {k: v for k, v in d.items() if k not in names and k != "command"}
        return cls(**known, extra=extra)

    @classmethod
    def read(cls, path: str | Path) -> RunSummary:
        """Read ``path`` (a run folder or its summary.json); ValueError if it is not one."""
        p = Path(path)
        file = p / "summary.json" if p.is_dir() else p
        d = json.loads(file.read_text())
        if not isinstance(d, dict):
            raise ValueError(f"{file} is not a JSON object")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The summary.json object: every field that is set, then the kept unknown keys."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None}
        command = self.command()
        return {**out, **self.extra, **({"command": command} if command else {})}

    def write(self, path: str | Path) -> None:
        """Write as indented JSON to ``path`` (a file)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def command(self) -> str | None:
        """The command line that reruns this run, every setting spelled out (defaults resolved).

        ``lowcomm train`` for a run on an open link; ``lowcomm compare`` with the bandwidth and
        topology for one behind a shaped link, into ``runs/reproduce/NAME``. None when the
        summary's config lacks a key of today's configs (written by an older version, or by
        hand): today's default would stand in for it.
        """
        if not self.config or not self.strategy:
            return None
        from ..config.parse import core_keys  # lazily: this module stays torch-free

        if core_keys() - set(self.config):
            return None  # an older summary lacks keys: today's defaults would not rerun it
        config = dict(self.config)
        if config.get("device") == "auto" and self.device:
            config["device"] = self.device.split(":")[0]  # the device it ran on, not a guess
        keys = [
            f"{k}={_plain(v)}"
            for k, v in config.items()
            if k not in _NOT_REPRODUCED and not (v == "" and k in ("faults", "replay"))
        ]
        folder = f"runs/reproduce/{self.name or self.strategy}"
        if self.bandwidth:
            head = [
                "lowcomm",
                "compare",
                "--strategies",
                self.strategy,
                "--workers",
                str(self.workers or 1),
                "--bandwidths",
                self.bandwidth,
                "--topology",
                self.topology or "shared",
                "--seeds",
                str(self.seed or 0),
            ]
        else:
            head = ["lowcomm", "train", "--strategy", self.strategy]
            head += ["--workers", str(self.workers or 1)]
        return shlex.join([*head, "--out", folder, *keys])

    @property
    def label(self) -> str:
        """The run's display name (its strategy when unnamed)."""
        return self.name or self.strategy or "?"

    def problem_key(self) -> str:
        """What the run was trained on: model, data, budget and world; equal keys are comparable."""
        cfg = self.config
        parts = {k: cfg.get(k) for k in _PROBLEM}
        return json.dumps({**parts, "corpus": self.data, "workers": self.workers}, sort_keys=True)

    def config_key(self) -> str:
        """Problem plus every setting that changes the result but the seed: equal keys are seeds."""
        cfg = {k: v for k, v in self.config.items() if k not in _BOOKKEEPING}
        return json.dumps(
            {"problem": self.problem_key(), "strategy": self.strategy, "config": cfg},
            sort_keys=True,
            default=str,
        )


def _plain(value: Any) -> str:
    """A config value as `key=value` text that the parser reads back to the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest text that reads back to the same float
    return str(value)


# --- the results table `lowcomm train` and `lowcomm compare` print ---------------------------


def fmt_bytes(n: float) -> str:
    """A byte count as text: 512 B, 1.5 KB, 2.3 MB, ..."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def results_table(results: list[RunSummary]) -> str:
    """Markdown table: loss, ratio to DDP on the same problem, wire bytes, reduction,
    utilization."""
    lines = [
        "| name | strategy | final val loss | vs DDP | wire bytes sent / worker | "
        "peak wire bytes / sync | fewer bytes than DDP FP32 | wall s | compute util. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ddp = ddp_reference(results, r)
        ratio = f"{r.final_val_loss / ddp:.3f}" if ddp else "-"
        sent = r.bytes_sent_per_worker or 0
        red = (r.ddp_fp32_bytes_per_worker or 0) / sent if sent else math.inf
        lines.append(
            f"| {r.label} | {r.strategy} | {r.final_val_loss:.4f} | {ratio} | "
            f"{fmt_bytes(sent)} | {fmt_bytes(r.peak_bytes_per_sync or 0)} | "
            f"{red:.1f}x | {r.wall_s or 0:.1f} | {r.compute_utilization or 0:.1%} |"
        )
    return "\n".join(lines)


def _is_baseline(r: RunSummary) -> bool:
    """A run of the data-parallel baseline under its own name (not a variant of it)."""
    from .. import strategies  # lazily: this module stays torch-free

    method = strategies.find(r.strategy)
    return method is not None and method.baseline and r.entry in (None, method.name)


def ddp_reference(results: list[RunSummary], run: RunSummary) -> float | None:
    """Mean final loss of the DDP runs trained on the same problem as ``run`` (None if none)."""
    key = run.problem_key()
    losses = [r.final_val_loss for r in results if _is_baseline(r) and r.problem_key() == key]
    return sum(losses) / len(losses) if losses else None


def written_since(out_dir: Path, t: float) -> bool:
    """Whether ``DIR/summary.json`` was written at or after ``t`` (``time.time()``): this
    run's summary, not one a resumed or overwritten run's folder held before."""
    with contextlib.suppress(OSError):
        return (out_dir / "summary.json").stat().st_mtime >= t
    return False
