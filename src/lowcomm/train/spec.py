"""One run's specification as one frozen value: what to train, how, where it writes, whether
it resumes; its settings tree (the engine's SyncConfig, the trainer's TrainConfig,
membership's MembershipConfig, the extensions' nodes) with the refusals of what an elastic run
does not do, each worded once, here or beside the rule it names in ``engine.placement``. Built
once (:meth:`RunSpec.of`) and passed whole from the CLI to every worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import strategies
from ..config import ConfigError, Configs, MembershipConfig, SyncConfig, TrainConfig
from ..elastic.membership import Elastic
from ..elastic.rounds import LIGHTHOUSE_JOIN_S
from ..engine.placement import EVICT_SITE_RANKS, QUORUM_SITE_RANKS, TWO_PHASE_ELASTIC
from ..strategies import Strategy

if TYPE_CHECKING:
    from .site_role import ElasticSite


EVICT_FIXED = (
    "evict=true excludes named sites from an elastic run: add elastic=true (a fixed world "
    "only names them)"
)
LAUNCH_SITES_ALONE = (
    "elastic=true with --workers starts sites of one rank: launch each site of several ranks "
    "on its own (torchrun --nproc-per-node R ... site=N sites=S lighthouse=...)"
)
TOO_FEW_WORKERS = "min_workers={min_workers} is more than --workers {workers}"
REPLAY_LOCKSTEP = "--replay re-enacts lock-step membership: drop rounds=quorum"


def site_membership(spec: RunSpec, site: ElasticSite) -> Elastic:
    """The membership settings of ``site`` (the library's :class:`lowcomm.Elastic`): what
    every site of the run shares, and where this one is and how it enters."""
    m, t = spec.membership, spec.train
    return Elastic(
        **{**m.shared(), "run_id": m.run_id or "lowcomm"},
        lighthouse=site.lighthouse,
        site=site.site,
        sites=site.starting or site.sites,
        timeout_s=t.timeout_s,
        connect_s=min(10.0, t.timeout_s),
        leave_after=site.leave_after,
        join=site.join,
        join_from=site.join_from,
        join_at=site.join_at,
        enter=site.alone,
        back=site.back,
        heal_at=site.heal_at,
    )


def lighthouse_options(spec: RunSpec, min_replicas: int) -> dict[str, int]:
    """A lighthouse's settings for this run's timeouts."""
    m = spec.membership
    # quorum rounds: the sites ask once a sync has closed, so the lighthouse waits only for
    # the rest of those asking (a moment), not for every live site as lock-step does
    join_s = LIGHTHOUSE_JOIN_S if m.rounds == "quorum" else spec.train.timeout_s
    return {
        "min_replicas": min_replicas,
        "join_timeout_ms": int(join_s * 1000),
        "quorum_tick_ms": 20,
        "heartbeat_timeout_ms": int(m.heartbeat_timeout_s * 1000),
    }


def check_membership(spec: RunSpec, workers: int, rejoin: bool) -> None:
    """One-line refusals of what an elastic run of ``workers`` sites cannot do, before any
    site starts; ``rejoin``: sites join it on the way (a replay's, or an extension's)."""
    m, cfg = spec.membership, spec.train
    spec.strategy.check_elastic(m, rejoin)
    if cfg.ranks_per_worker != 1:
        if m.site < 0:
            raise ConfigError(LAUNCH_SITES_ALONE)
        if m.rounds == "quorum":
            raise ConfigError(QUORUM_SITE_RANKS)
        if spec.sync.evict:
            raise ConfigError(EVICT_SITE_RANKS)
    if spec.sync.resolved_reduce == "two-phase":  # (the engine refuses it too, for own loops)
        raise ConfigError(TWO_PHASE_ELASTIC)
    if m.min_workers > workers:
        raise ConfigError(TOO_FEW_WORKERS.format(min_workers=m.min_workers, workers=workers))
    if m.rounds == "quorum" and m.replay:
        # where a round is cut short depends on timing, not on the record
        raise ConfigError(REPLAY_LOCKSTEP)
    m.check_sites(workers)  # against the run's own size (a site's Elastic: its own)


def check_fixed(spec: RunSpec) -> None:
    """Refusals of what only an elastic run does, for a fixed world's ``spec``."""
    if spec.sync.evict:
        raise ConfigError(EVICT_FIXED)


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
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    """An elastic run's settings (``membership.elastic``: whether it is one)."""
    extensions: dict[str, Any] = field(default_factory=dict)
    """The settings of each extension (:class:`.extensions.Extension`) this run's settings
    named, by name."""

    @classmethod
    def of(
        cls,
        strategy: str | Strategy,
        configs: Configs,
        out: str | Path,
        name: str | None = None,
        resume: str | Path | None = None,
    ) -> RunSpec:
        """The spec of a run of ``strategy`` (a name or a registered Strategy) with the
        settings tree ``configs``."""
        return cls(
            strategies.get(strategy),
            configs.sync,
            configs.train,
            Path(out),
            name,
            str(resume) if resume is not None else None,
            configs.membership,
            dict(configs.extensions),
        )

    @property
    def elastic(self) -> bool:
        """Whether this is an elastic run of sites."""
        return self.membership.elastic

    @property
    def label(self) -> str:
        """The run's name in logs and reports."""
        return self.name or self.strategy.name

    def replace(self, **changes: Any) -> RunSpec:
        """A copy with ``changes`` (e.g. another ``train`` config for a site, or ``resume``)."""
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """The settings as saved with checkpoints and in an elastic run's DIR/elastic.json:
        what ``--resume`` and ``lowcomm join`` rebuild the run from (every node by name)."""
        return {
            "strategy": self.strategy.name,
            "name": self.name,
            "sync": dataclasses.asdict(self.sync),
            "train": dataclasses.asdict(self.train),
            "membership": dataclasses.asdict(self.membership),
            "extensions": {n: dataclasses.asdict(e) for n, e in self.extensions.items()},
        }

    def configs(self) -> Configs:
        """The settings tree of this run."""
        return Configs(self.sync, self.train, self.membership, dict(self.extensions))


def saved_values(run: dict[str, Any]) -> dict[str, Any]:
    """A run's saved settings (:meth:`RunSpec.settings`, or the flat ``sync`` and ``train``
    dicts of runs saved before the tree) as one dict of keys."""
    values: dict[str, Any] = {**run["sync"], **run["train"], **run.get("membership", {})}
    for node in run.get("extensions", {}).values():
        values.update(node)
    return values
