"""Membership's settings: what every site of an elastic run shares (:class:`MembershipSettings`,
which a site's :class:`lowcomm.Elastic` holds too), and the trainer's node of them
(:class:`MembershipConfig`: whether the run is elastic, its lighthouse, and where its sites
are launched). Each rule is checked here, once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from .checks import check_types
from .choices import Late, Rounds, Weighting
from .schema import knob

WEIGHTINGS = ("steps", "plain", "normalized")


@dataclass(frozen=True)
class MembershipSettings:
    """What every site of one elastic run must share about who is in it and how a sync closes."""

    min_workers: int = knob(1, "With elastic: fewer live sites than this stop the run.")
    run_id: str = knob(
        "",
        "With elastic: the run's name, shared by its sites: it names them at the lighthouse "
        "and, with a secret, keys their MACs, so two runs on one lighthouse never meet. '' = a "
        "fresh one per launch; with site=, one derived from the run's settings (set it apart "
        "for two runs of the same settings on one lighthouse) and kept in the site's folder.",
    )
    rounds: Rounds = knob(
        "lockstep",
        "lockstep: every sync waits for every live site; quorum: a sync closes once `quorum` "
        "sites reached it plus `grace`, slower sites cut their round short and are weighted by "
        "the steps they took (turns elastic on).",
    )
    quorum: int = knob(0, "With rounds=quorum: sites that close a sync (0 = a majority).")
    grace: float = knob(
        0.0,
        "With rounds=quorum: seconds a closed quorum waits for the rest (0 = auto: 3x the "
        "slowest site's inner step).",
    )
    late: Late = knob(
        "carry",
        "With rounds=quorum: a site that misses a sync carries its work into its next one "
        "(carry) or drops it and restarts from the run's model (drop).",
    )
    weighting: Weighting = knob(
        "steps",
        "With rounds=quorum: how contributions of unequal inner steps h merge: steps (weight "
        "h), plain (each once) or normalized (each per step, weight 1/h). Equal steps: all "
        "three are the plain mean.",
    )
    secret_file: str = knob(
        "",
        "With elastic: a file holding the run's secret (else $LOWCOMM_SECRET; never on a "
        "command line): only sites holding it are admitted, and quorum requests, round hints "
        "and heals carry a MAC under a key derived from it and the run id.",
    )

    def __post_init__(self) -> None:
        check_types(self)
        if self.min_workers < 1:
            raise ConfigError(f"min_workers must be >= 1, got {self.min_workers}")
        if self.rounds == "lockstep" and (self.quorum or self.grace):
            raise ConfigError("quorum= and grace= set quorum rounds: add rounds=quorum")
        if self.rounds == "lockstep" and self.weighting != "steps":
            raise ConfigError("weighting= merges quorum rounds' unequal steps: add rounds=quorum")
        if self.grace < 0:
            raise ConfigError(f"grace must be >= 0 seconds (0 = auto), got {self.grace:g}")
        if self.quorum < 0:
            raise ConfigError(f"quorum must be >= 0 (0 = a majority), got {self.quorum}")
        if self.run_id:
            from ..elastic.messages import check_run_id

            check_run_id(self.run_id)

    def check_sites(self, sites: int) -> None:
        """The rules that depend on how many sites start the run (ConfigError, one line)."""
        if not 1 <= self.min_workers <= sites:
            raise ConfigError(f"min_workers must be in [1, sites={sites}], got {self.min_workers}")
        if self.quorum and not sites // 2 < self.quorum <= sites:
            # torchft's lighthouse forms a quorum only from more than half of the live sites
            raise ConfigError(
                f"quorum must be more than half of the {sites} sites and at most {sites} "
                f"(the lighthouse's majority rule): try quorum={sites // 2 + 1}, got "
                f"{self.quorum}"
            )

    def shared(self) -> dict[str, Any]:
        """These settings by name (what a site's :class:`lowcomm.Elastic` takes of them)."""
        return {f.name: getattr(self, f.name) for f in fields(MembershipSettings)}


@dataclass(frozen=True)
class MembershipConfig(MembershipSettings):
    """The trainer's membership settings: an elastic run of sites, where they meet and how
    they are launched (besides what every site shares)."""

    elastic: bool = knob(
        False,
        "Sites come and go: a lost site leaves the run and the others go on (membership on "
        "torchft's lighthouse, one quorum per outer sync). Outer-loop strategies.",
    )
    lighthouse: str = knob(
        "", "With elastic: HOST:PORT of a running torchft lighthouse ('' = start one here)."
    )
    heartbeat_timeout_s: float = knob(
        2.0, "With elastic: a site silent this long is left out of the next sync."
    )
    site: int = knob(
        -1,
        "With elastic and lighthouse=: run only site N of the run, here (each site launched "
        "by its own command, on its own machine, into its own --out); the same command brings "
        "it back into a running run (it heals). -1 = every site on this machine.",
    )
    sites: int = knob(0, "With site=: how many sites start the run.")
    replay: str = knob(
        "",
        "With elastic: a membership.jsonl to re-enact: each site leaves at the sync it left "
        "in that run, with no real fault. Also --replay.",
    )

    def __post_init__(self) -> None:
        if self.rounds == "quorum" and not self.elastic:
            # quorum rounds are settled by the lighthouse's quorums
            object.__setattr__(self, "elastic", True)
        super().__post_init__()
        elastic_only = {
            "secret_file": "secret_file admits elastic sites",
            "run_id": "run_id names an elastic run",
            "replay": "replay= re-enacts an elastic run",
        }
        for key, what in elastic_only.items():
            if getattr(self, key) and not self.elastic:
                raise ConfigError(f"{what}: add elastic=true")
        if self.secret_file:
            from ..elastic.admission import read_secret

            read_secret(self.secret_file)  # unreadable or empty: said now, before any start
        if self.heartbeat_timeout_s <= 0:
            raise ConfigError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if self.site >= 0:
            self._check_own_site()

    def _check_own_site(self) -> None:
        """A site launched on its own (``site=N sites=S``): what it needs, one line each."""
        if not self.elastic:
            raise ConfigError("site= runs one site of an elastic run: add elastic=true")
        if not self.lighthouse:
            raise ConfigError(
                "site= joins the sites at a lighthouse they all reach: start one with "
                "`lowcomm lighthouse --port P` and add lighthouse=HOST:P"
            )
        if not 0 <= self.site < self.sites:
            raise ConfigError(f"site={self.site} must be in [0, sites={self.sites}): give sites=S")
