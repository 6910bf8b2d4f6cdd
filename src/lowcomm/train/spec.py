"""One run's specification as one frozen value: what to train, how, where it writes, whether
it resumes. Built once (:meth:`RunSpec.of`) and passed whole from the CLI to every worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import strategies
from ..config import SyncConfig, TrainConfig
from ..strategies import Strategy


@dataclass(frozen=True)
class RunSpec:
    """A run as the user asked for it (settings already checked by the configs)."""

    strategy: Strategy
    sync: SyncConfig
    train: TrainConfig
    out: Path
    name: str | None = None
    """The run's label in reports (default: the strategy's name)."""
    resume: str | None = None
    """A checkpoint folder to continue from."""

    @classmethod
    def of(
        cls,
        strategy: str | Strategy,
        sync: SyncConfig,
        train: TrainConfig,
        out: str | Path,
        name: str | None = None,
        resume: str | Path | None = None,
    ) -> RunSpec:
        """The spec of a run of ``strategy`` (a name or a registered Strategy)."""
        return cls(
            strategies.get(strategy),
            sync,
            train,
            Path(out),
            name,
            str(resume) if resume is not None else None,
        )

    @property
    def label(self) -> str:
        """The run's name in logs and reports."""
        return self.name or self.strategy.name

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` (e.g. another ``train`` config for a site, or ``resume``)."""
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """The settings as saved with checkpoints and in an elastic run's DIR/elastic.json:
        what ``--resume`` and ``lowcomm join`` rebuild the run from."""
        return {
            "strategy": self.strategy.name,
            "name": self.name,
            "sync": dataclasses.asdict(self.sync),
            "train": dataclasses.asdict(self.train),
        }
