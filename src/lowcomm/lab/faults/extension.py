"""The lab's extension of the trainer: faults on purpose (``faults=``, ``--faults``) and shaped
links between an elastic run's sites (``site_link=``). Its settings are one node of a run's
settings tree; the trainer calls it before any worker starts (:meth:`Lab.check`), in the local
launcher of an elastic run (:meth:`Lab.plan`: the sites started again or added, those that
pause, the network namespaces, the lighthouse's outages) and in each worker
(:meth:`Lab.callbacks`: the site's :class:`~.harness.Harness`)."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowcomm.config import ConfigError, check_types, knob
from lowcomm.train.elastic import SitePlan
from lowcomm.train.extensions import Extension, register

from . import LIGHTHOUSE_FAULT, Fault, adds, decoded, joins, lighthouse_down, links, parse_faults
from .forge import PAYLOAD_ATTACKS

if TYPE_CHECKING:
    from lowcomm.train.callbacks import TrainerCallback
    from lowcomm.train.lighthouse import Keeper
    from lowcomm.train.spec import RunSpec

CORRUPT_SUMMED = (
    "--faults {fault}: a corrupt payload is refused where payloads are decoded; this run "
    "all-reduces sums: use a codec sent by reduce=gather or two-phase (e.g. codec=int8)"
)
JOIN_FIXED = "--faults join/add: a site can join only an elastic run: add elastic=true"
LIGHTHOUSE_FIXED = "--faults lighthouse: only an elastic run has one: add elastic=true"
LINK_FIXED = "--faults link: cuts an elastic site's data plane: add elastic=true"
NOT_OUR_LIGHTHOUSE = (
    "--faults lighthouse: kills the lighthouse the launcher started; lighthouse={address} is "
    "not ours to kill: drop lighthouse= or the fault"
)
LINK_PEER = "{what}: not for {strategy}: use a lowcomm strategy"
LINK_REPLAY = "{what}: a replay runs without faults on loopback: drop {what}"
LINK_LIGHTHOUSE = (
    "{what}: the sites then run in network namespaces that reach only the launcher's "
    "lighthouse, not lighthouse={address}: drop lighthouse= or {what}"
)
OWN_SITE = (
    "site= runs one site as deployed: site_link= and --faults are the local launcher's "
    "(kill a site from its own shell instead)"
)


@register
@dataclass(frozen=True)
class Lab(Extension):
    """The lab's settings of a run: the faults it acts out and the links between its sites."""

    name = "lab"
    faults: str = knob(
        "",
        "Faults on purpose, KIND:SITE@STEP comma-separated, sites 0-based: kill:2@35 "
        "(SIGKILL before step 35), hang:2@55 (SIGSTOP), pause:2@40x8 (SIGSTOP, SIGCONT 8 s "
        "later), join:2@60, add:3@60, slow:1x3, slowlink:1x0.2 (each collective waits 0.2 s), "
        "corrupt:1@35 (a payload the others refuse), healer:0@40, collective:0@40 (dies inside "
        "a handover or a sync), lighthouse:0@30x3, link:2@40x20 (its data plane cut for "
        "20 s); attacks on what a site sends: signflip:1@20, scale:1x1000, noise:1x2, zero:1, "
        "nan:1, and with reduce=gather copy:1 (another site's last send), alie:1 (a little is "
        "enough); insiders (with a run secret): liar:2@30, dissent:2@30, accuse:2@30, "
        "ender:2@30 (says mid-run it finished). Also --faults.",
    )
    site_link: str = knob(
        "",
        "With elastic: each site in a network namespace of its own, on a link of this rate "
        "(tc style, e.g. 50mbit) to a switch that holds the lighthouse; needs root and "
        "iproute2 ('' = every site on this machine's loopback).",
    )

    def __post_init__(self) -> None:
        check_types(self)
        if self.site_link:
            from ..netshape.units import parse_rate

            try:
                parse_rate(self.site_link)
            except ValueError as e:
                raise ConfigError(f"site_link={self.site_link}: {e}") from None

    def parsed(self, starting: int, steps: int) -> list[Fault]:
        """The faults, read for a run that ``starting`` sites begin and of ``steps`` steps."""
        return parse_faults(self.faults, starting, steps)

    # -- before any worker starts ----------------------------------------------------------------
    def check(self, spec: RunSpec, workers: int) -> None:
        """The faults read (a typo said now, not by every worker), and what they need of the
        run; the links' needs."""
        faults = self.parsed(workers, spec.train.steps)
        m = spec.membership
        if m.site >= 0 and (self.faults or self.site_link):
            raise ConfigError(OWN_SITE)
        if self.site_link and not m.elastic:
            raise ConfigError("site_link puts elastic sites in namespaces: add elastic=true")
        if decoded(faults) and (spec.strategy.per_step or spec.sync.resolved_reduce == "allreduce"):
            raise ConfigError(CORRUPT_SUMMED.format(fault=decoded(faults)[0]))
        forged = sorted({f.kind for f in faults if f.kind in PAYLOAD_ATTACKS})
        if "alie" in forged and m.elastic:
            raise ConfigError(
                "--faults alie: its colluders tell their own rows apart by group rank, which is "
                "a site's number only in a fixed world: drop elastic=true for this attack"
            )
        if forged and spec.sync.resolved_reduce != "gather":
            raise ConfigError(
                f"--faults {'/'.join(forged)} forges a site's sends from the others' last ones, "
                f"which only reduce=gather hands every site (this run: "
                f"{spec.sync.resolved_reduce}): add reduce=gather"
            )
        rejoin = bool({**joins(faults), **adds(faults)})
        if not m.elastic:
            for bad, why in ((rejoin, JOIN_FIXED), (lighthouse_down(faults), LIGHTHOUSE_FIXED),
                             (links(faults), LINK_FIXED)):  # fmt: skip
                if bad:
                    raise ConfigError(why)
            return
        if links(faults) or self.site_link:
            self._check_links(spec)
        if rejoin:
            spec.strategy.check_elastic(m, True)
        if lighthouse_down(faults) and m.lighthouse:
            raise ConfigError(NOT_OUR_LIGHTHOUSE.format(address=m.lighthouse))

    def _check_links(self, spec: RunSpec) -> None:
        """A ``link:`` fault or ``site_link`` runs the sites in namespaces the launcher makes:
        refused, with the reason, where it cannot."""
        from ..netshape.errors import NetworkUnavailable
        from ..netshape.namespaces import require_root_and_iproute2

        what = f"site_link={self.site_link}" if self.site_link else "--faults link"
        m = spec.membership
        if spec.strategy.peer:  # torchft's Managers meet at a lighthouse of this machine's own
            raise ConfigError(LINK_PEER.format(what=what, strategy=spec.strategy.name))
        if m.replay:
            raise ConfigError(LINK_REPLAY.format(what=what))
        if m.lighthouse:
            raise ConfigError(LINK_LIGHTHOUSE.format(what=what, address=m.lighthouse))
        try:
            require_root_and_iproute2()
        except NetworkUnavailable as e:
            raise ConfigError(f"{what}: {e}") from None

    # -- the local launcher of an elastic run ------------------------------------------------------
    def plan(self, spec: RunSpec, workers: int) -> SitePlan | None:
        """The sites that join again after a kill (``join:``) or join added (``add:``), those
        that pause, the sites' network namespaces (``link:``, ``site_link``) and the
        lighthouse's outages (``lighthouse:``)."""
        faults = self.parsed(workers, spec.train.steps)
        if not faults and not self.site_link:
            return None
        again = {s: {"join_from": n} for s, n in joins(faults).items()}
        added = {s: {"join_from": n} for s, n in adds(faults).items()}
        net = None
        if links(faults) or self.site_link:
            net = SiteNetwork(self.site_link, workers + len(added))
        ask = spec.out / LIGHTHOUSE_FAULT
        return SitePlan(
            again=again,
            added=added,
            pausing=frozenset(f.site for f in faults if f.kind == "pause"),
            network=net,
            tick=functools.partial(_lighthouse_outage, ask) if lighthouse_down(faults) else None,
            close=functools.partial(_remove, ask),
        )

    # -- each worker -----------------------------------------------------------------------------
    def callbacks(self, spec: RunSpec, site: int, starting: int) -> list[TrainerCallback]:
        """The site's harness, acting out its own faults."""
        from .harness import Harness

        faults = self.parsed(starting, spec.train.steps)
        return [Harness(faults, site, spec.out)] if faults else []


def _lighthouse_outage(ask: Path, keeper: Keeper) -> None:
    """A site's ``lighthouse:`` request (a file in the run's folder): the lighthouse is killed
    and started again after that fault's seconds."""
    with contextlib.suppress(OSError, ValueError):
        seconds = float(ask.read_text().strip() or 0)
        ask.unlink()
        print(f"lowcomm: fault: the lighthouse is killed; it starts again in {seconds:g} s",
              flush=True)  # fmt: skip
        keeper.restart(seconds)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


class SiteNetwork:
    """A network namespace for each site and one for the lighthouse (the switch), bridged,
    each site's uplink shaped at ``rate`` (a nominal 10gbit without one: namespaces to cut a
    site's link in, not to shape it)."""

    def __init__(self, rate: str, sites: int) -> None:
        from ..netshape.network import ShapedNetwork

        self.net = ShapedNetwork(
            rate or "10gbit", topology="per-worker", workers=sites, check=False,
            name_prefix="lcsites",
        ).__enter__()  # fmt: skip
        self.lighthouse_host = self.net.switch_addr

    def site_setup(self, site: int, lighthouse: str) -> Any:
        """What site ``site``'s process runs first: into its namespace, its addresses set."""
        net = self.net
        return functools.partial(
            _enter_site, net.namespace(site), net.address(site), net.uplink, lighthouse
        )

    def lighthouse_setup(self) -> Any:
        """What the lighthouse's process runs first: into the switch's namespace."""
        from ..netshape.namespaces import enter

        return functools.partial(enter, self.net.switch)

    def close(self) -> None:
        """Delete the namespaces (and with them the links)."""
        self.net.close()


def _enter_site(netns: str, addr: str, uplink: str, lighthouse: str) -> None:
    """In a site's process, before any socket: its namespace, and where its store and groups
    listen, which interface gloo uses, where the lighthouse is (a ``link:`` cut keeps it) and
    the uplink's shaping (a cut puts it back)."""
    from ..netshape.links import WORKER_IFNAME
    from ..netshape.namespaces import enter

    enter(netns)
    os.environ.update(
        LOWCOMM_ADDR=addr,
        GLOO_SOCKET_IFNAME=WORKER_IFNAME,
        LOWCOMM_LIGHTHOUSE=lighthouse,
        LOWCOMM_UPLINK=uplink,
    )
