"""Where a run's progress goes (rank 0 only): metrics.jsonl, the terminal, logs, TensorBoard.

- ``DIR/metrics.jsonl``: one JSON record per logged step (always);
- a progress bar when stderr is a terminal, else one plain line per logged step (step, loss,
  MB sent, tokens/s), so jobs under a scheduler show progress in their log files;
- ``log=tensorboard``: an event file in ``DIR/tensorboard/`` with loss, bytes and utilization
  (needs the optional ``tensorboard`` package: ``pip install 'lowcomm[tensorboard]'``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from ..config import ConfigError

TENSORBOARD_HINT = (
    "log=tensorboard needs the tensorboard package: pip install 'lowcomm[tensorboard]'"
)


def check_log_backend(name: str) -> None:
    """ConfigError now (before workers start) when the chosen backend cannot be used."""
    if name == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError(TENSORBOARD_HINT) from None


class RunLog:
    """Rank 0's outputs of a run's progress; on other ranks every method does nothing."""

    def __init__(
        self,
        out: Path,
        rank: int,
        *,
        start_step: int,
        total_steps: int,
        desc: str,
        progress: bool = True,
        backend: str = "none",
        stream: IO[str] | None = None,
        append: bool = False,
    ) -> None:
        self.active = rank == 0
        self.started = 0.0  # when the training loop began (see begin)
        self.stream = stream if stream is not None else sys.stderr
        self.file = None
        if self.active:  # append: a site back in its own folder keeps what it logged before
            has = append and (out / "metrics.jsonl").exists()
            self.file = open(out / "metrics.jsonl", "a") if has else _open_metrics(out, start_step)
        self.bar = None
        self.plain = False
        if self.active and progress:
            if self.stream.isatty():  # no \r-spam in logs and CI
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total_steps,
                    initial=start_step - 1,
                    desc=desc,
                    unit="step",
                    leave=False,
                    dynamic_ncols=True,
                    file=self.stream,
                )
            else:
                self.plain = True
        self.desc = desc
        self.tb = _tensorboard_writer(out) if self.active and backend == "tensorboard" else None

    def begin(self) -> None:
        """The training loop begins: ``elapsed_s`` of every record counts from now."""
        self.started = time.perf_counter()

    def record(self, rec: dict[str, Any]) -> None:
        """Write one metrics record, stamped with ``elapsed_s`` (seconds since :meth:`begin`,
        everything included: logging, evaluation and waits outside the timed steps, which
        ``wall_s`` leaves out), and show it (bar, plain line, TensorBoard)."""
        elapsed = round(time.perf_counter() - self.started, 3) if self.started else 0.0
        rec = {**rec, "elapsed_s": elapsed}
        if not self.active:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            _to_tensorboard(self.tb, rec)
        loss = rec.get("train_loss", rec.get("val_loss", float("nan")))
        mb = rec.get("bytes_sent", 0) / 1e6
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", MB=f"{mb:.1f}", refresh=False)
        elif self.plain and "train_loss" in rec:
            tps = rec["tokens"] / rec["wall_s"] if rec.get("wall_s") else 0.0
            print(
                f"[{self.desc}] step {rec['step']}: loss {loss:.4f}, {mb:.1f} MB sent, "
                f"{tps:,.0f} tokens/s",
                file=self.stream,
                flush=True,
            )

    def step_done(self) -> None:
        """Advance the progress bar by one step."""
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        """Close the bar, the metrics file and the event file."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _open_metrics(out: Path, start_step: int) -> IO[str]:
    """metrics.jsonl; on resume, records after the checkpoint are dropped, then appended to."""
    path = out / "metrics.jsonl"
    if start_step > 1 and path.exists():
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut short when the run was stopped: drop it
                continue
        keep = [r for r in records if r.get("step", 0) < start_step and not r.get("final")]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        return open(path, "a")
    return open(path, "w")


def _tensorboard_writer(out: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(TENSORBOARD_HINT) from None
    return SummaryWriter(log_dir=str(out / "tensorboard"))


# metrics.jsonl key -> TensorBoard tag
_TAGS = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "bytes_sent": "bytes/sent_per_worker",
    "payload_bytes": "bytes/payload_per_worker",
    "lr": "lr",
    "utilization": "time/utilization",
}


def _to_tensorboard(writer: Any, rec: dict[str, Any]) -> None:
    """One scalar per known key, at the record's step; utilization = compute / wall so far."""
    values = dict(rec)
    if rec.get("wall_s") and "compute_s" in rec:
        values["utilization"] = rec["compute_s"] / rec["wall_s"]
    for key, tag in _TAGS.items():
        if key in values:
            writer.add_scalar(tag, float(values[key]), global_step=int(rec["step"]))
    writer.flush()
