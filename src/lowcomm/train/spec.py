"""One run's specification as one frozen value: what to train, how, where it writes, whether
it resumes, and an elastic run's settings (:class:`ElasticSpec`, with every refusal of what
elastic mode does not do, each worded once, here or beside the rule it names in
``engine.placement``). Built once (:meth:`RunSpec.of`) and passed whole from the CLI to every
worker."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import strategies
from ..config import ConfigError, SyncConfig, TrainConfig
from ..elastic.membership import Elastic, check_rounds
from ..elastic.rounds import LIGHTHOUSE_JOIN_S
from ..engine.placement import EVICT_SITE_RANKS, QUORUM_SITE_RANKS, TWO_PHASE_ELASTIC
from ..faults import Fault, adds, decoded, joins, lighthouse_down, links
from ..strategies import Strategy

if TYPE_CHECKING:
    from .site_role import ElasticSite


CORRUPT_SUMMED = (
    "--faults {fault}: a corrupt payload is refused where payloads are decoded; this run "
    "all-reduces sums: use a codec sent by reduce=gather or two-phase (e.g. codec=int8)"
)
JOIN_FIXED = "--faults join/add: a site can join only an elastic run: add elastic=true"
LIGHTHOUSE_FIXED = "--faults lighthouse: only an elastic run has one: add elastic=true"
LINK_FIXED = "--faults link: cuts an elastic site's data plane: add elastic=true"
EVICT_FIXED = (
    "evict=true excludes named sites from an elastic run: add elastic=true (a fixed world "
    "only names them)"
)
NOT_OUR_LIGHTHOUSE = (
    "--faults lighthouse: kills the lighthouse the launcher started; lighthouse={address} is "
    "not ours to kill: drop lighthouse= or the fault"
)
LAUNCH_SITES_ALONE = (
    "elastic=true with --workers starts sites of one rank: launch each site of several ranks "
    "on its own (torchrun --nproc-per-node R ... site=N sites=S lighthouse=...)"
)
TOO_FEW_WORKERS = "min_workers={min_workers} is more than --workers {workers}"
REPLAY_LOCKSTEP = "--replay re-enacts lock-step membership: drop rounds=quorum"
LINK_PEER = "{what}: not for {strategy}: use a lowcomm strategy"
LINK_REPLAY = "{what}: a replay runs without faults on loopback: drop {what}"
LINK_LIGHTHOUSE = (
    "{what}: the sites then run in network namespaces that reach only the launcher's "
    "lighthouse, not lighthouse={address}: drop lighthouse= or {what}"
)


@dataclass(frozen=True)
class ElasticSpec:
    """An elastic run's settings (see the knobs of the same names in ``lowcomm train --help``)."""

    min_workers: int = 1
    lighthouse: str = ""  # '' = the launcher starts one
    heartbeat_timeout_s: float = 2.0
    timeout_s: float = 60.0
    rounds: str = "lockstep"
    quorum: int = 0
    grace: float = 0.0
    late: str = "carry"
    weighting: str = "steps"
    secret_file: str = ""
    site_link: str = ""
    replay: str = ""
    run_id: str = "lowcomm"

    @classmethod
    def of(cls, train: TrainConfig) -> ElasticSpec | None:
        """The elastic settings of ``train`` (None for a fixed world)."""
        if not train.elastic:
            return None
        return cls(
            train.min_workers, train.lighthouse, train.heartbeat_timeout_s, train.timeout_s,
            train.rounds, train.quorum, train.grace, train.late, train.weighting,
            train.secret_file, train.site_link, train.replay, train.run_id or "lowcomm",
        )  # fmt: skip

    def for_site(self, site: ElasticSite) -> Elastic:
        """The membership settings of ``site`` (the library's :class:`lowcomm.Elastic`)."""
        return Elastic(
            lighthouse=site.lighthouse, site=site.site, sites=site.starting or site.sites,
            min_workers=self.min_workers, timeout_s=self.timeout_s,
            connect_s=min(10.0, self.timeout_s), leave_after=site.leave_after, join=site.join,
            join_from=site.join_from, join_at=site.join_at, enter=site.alone, back=site.back,
            heal_at=site.heal_at, rounds=self.rounds, quorum=self.quorum, grace=self.grace,
            late=self.late, weighting=self.weighting, secret_file=self.secret_file,
            run_id=self.run_id,
        )  # fmt: skip

    def lighthouse_options(self, min_replicas: int) -> dict[str, int]:
        """A lighthouse's settings for this run's timeouts."""
        # quorum rounds: the sites ask once a sync has closed, so the lighthouse waits only for
        # the rest of those asking (a moment), not for every live site as lock-step does
        join_s = LIGHTHOUSE_JOIN_S if self.rounds == "quorum" else self.timeout_s
        return {
            "min_replicas": min_replicas,
            "join_timeout_ms": int(join_s * 1000),
            "quorum_tick_ms": 20,
            "heartbeat_timeout_ms": int(self.heartbeat_timeout_s * 1000),
        }

    def check(self, spec: RunSpec, workers: int, faults: list[Fault]) -> None:
        """One-line refusals of what this elastic run cannot do, before any site starts."""
        cfg = spec.train
        if links(faults) or self.site_link:
            self._check_links(spec)
        spec.strategy.check_elastic(cfg, bool({**joins(faults), **adds(faults)}))
        if lighthouse_down(faults) and self.lighthouse:
            raise ConfigError(NOT_OUR_LIGHTHOUSE.format(address=self.lighthouse))
        if cfg.ranks_per_worker != 1:
            self._check_site_ranks(spec)
        if spec.sync.resolved_reduce == "two-phase":  # (the engine refuses it too, for own loops)
            raise ConfigError(TWO_PHASE_ELASTIC)
        if self.min_workers > workers:
            raise ConfigError(TOO_FEW_WORKERS.format(min_workers=self.min_workers, workers=workers))
        if self.rounds == "quorum" and self.replay:
            # where a round is cut short depends on timing, not on the record
            raise ConfigError(REPLAY_LOCKSTEP)
        if self.rounds == "quorum":  # against the run's own size (a site's Elastic: its own)
            check_rounds(self.rounds, self.quorum, self.grace, self.late, workers)

    def _check_site_ranks(self, spec: RunSpec) -> None:
        """Sites of several ranks: launched one per site, lock-step, nobody evicted."""
        if spec.train.site < 0:
            raise ConfigError(LAUNCH_SITES_ALONE)
        if self.rounds == "quorum":
            raise ConfigError(QUORUM_SITE_RANKS)
        if spec.sync.evict:
            raise ConfigError(EVICT_SITE_RANKS)

    def _check_links(self, spec: RunSpec) -> None:
        """A ``link:`` fault or ``site_link`` runs the sites in namespaces the launcher makes:
        refused, with the reason, where it cannot."""
        from ..netshape.errors import NetworkUnavailable
        from ..netshape.namespaces import require_root_and_iproute2

        what = f"site_link={self.site_link}" if self.site_link else "--faults link"
        if spec.strategy.peer:  # torchft's Managers meet at a lighthouse of this machine's own
            raise ConfigError(LINK_PEER.format(what=what, strategy=spec.strategy.name))
        if self.replay:
            raise ConfigError(LINK_REPLAY.format(what=what))
        if self.lighthouse:
            raise ConfigError(LINK_LIGHTHOUSE.format(what=what, address=self.lighthouse))
        try:
            require_root_and_iproute2()
        except NetworkUnavailable as e:
            raise ConfigError(f"{what}: {e}") from None


def check_fixed(spec: RunSpec, faults: list[Fault]) -> None:
    """Refusals of what only an elastic run does, for a fixed world's ``spec``."""
    if {**joins(faults), **adds(faults)}:
        raise ConfigError(JOIN_FIXED)
    if lighthouse_down(faults):
        raise ConfigError(LIGHTHOUSE_FIXED)
    if links(faults):
        raise ConfigError(LINK_FIXED)
    if spec.sync.evict:
        raise ConfigError(EVICT_FIXED)


def check_corrupt(spec: RunSpec, faults: list[Fault]) -> None:
    """A ``corrupt:`` fault needs payloads that are decoded (an all-reduce sums numbers)."""
    if decoded(faults) and (spec.strategy.per_step or spec.sync.resolved_reduce == "allreduce"):
        raise ConfigError(CORRUPT_SUMMED.format(fault=decoded(faults)[0]))


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
    def elastic(self) -> ElasticSpec | None:
        """An elastic run's settings, read from ``train`` (None for a fixed world)."""
        return ElasticSpec.of(self.train)

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
