"""Faults on purpose: the ``--faults`` grammar and the launcher's side of it; a site acts its
own out through a :class:`.harness.Harness`, which the trainer hands the engine as its fault
hooks (``LowComm.faults``). The engine, the aggregators and the protocol import nothing from
here: they call the hooks they were given (:class:`lowcomm.protocols.FaultHooks`, none by
default).

``KIND:SITE[@STEP][xFACTOR]``, comma-separated, sites 0-based:

- ``kill:2@35``  site 2 is SIGKILLed before its inner step 35 (as ``kill -9`` from a shell);
- ``hang:2@55``  site 2 stops answering before step 55 (SIGSTOP: alive, silent);
- ``pause:2@40x8`` site 2 is stopped before step 40 and goes on 8 seconds later (SIGSTOP, then
  SIGCONT from a helper process it starts first): a long GC pause, a VM migration, a
  suspended laptop. Back, it finds the run gone on without it if its heartbeat lapsed, and
  then it alone stops, with one line; the others never stop for it;
- ``join:2@60``  site 2, killed earlier, is started again and joins the run at its first sync
  at or after step 60 (it heals from a live peer);
- ``add:3@60``   a new site, 3 (of a run started with 3: sites are numbered on from the
  run's), joins at the run's first sync at or after step 60 (it heals from a live peer). The
  run's data is cut into as many shards as it will have sites, so every site has its own;
- ``corrupt:1@40`` site 1 spoils what it sends at its first sync from step 40 (the validity
  flag of every payload it sends there: an invalid byte, as a bit flip or a faulty encoder
  would leave). Every receiver refuses it the same way, so the site is named and excluded, and
  the others retry the sync without it; it stops alone, with one line. For runs whose payloads
  are decoded (``reduce=gather`` or ``two-phase``; an all-reduce sums numbers, and a spoilt sum
  is the subject of robust merges, not of the protocol);
- ``healer:0@40`` site 0 dies (SIGKILL) inside the first heal it hands over at or after step 40,
  after the joiner learnt the state's size and before the state itself: the members go on
  without it and the joiner asks again and heals from another member;
- ``collective:0@40`` site 0 dies (SIGKILL) inside the first sync it takes part in at or
  after step 40, once that sync's group has formed, as its peers enter the collectives (site
  0 is the lowest member: it hosts the group's store too). The others fail the attempt and
  retry without it;
- ``stall:2@40`` site 2 stops (SIGSTOP) inside the first sync it takes part in at or after
  step 40, as ``collective:`` dies: a host wedged mid-collective. Its peers wait for it at most
  the sync's deadline (docs/reliability.md), then go on without it;
- ``lighthouse:0@30x3`` the lighthouse dies when site 0 reaches step 30 (the launcher, asked by
  that site before its step 30, SIGKILLs the lighthouse's process) and the launcher starts it
  again at the same address 3 seconds later. The sites train on; their next quorum request
  waits for it (see docs/reliability.md). Only for a lighthouse the launcher started (no
  ``lighthouse=``);
- ``link:2@40x20`` site 2's network breaks on the data plane for 20 seconds from its step 40:
  every packet it sends is dropped but those to the lighthouse (tc, on its interface), so it is
  alive and heard but its peers cannot reach it, nor it them. The members that cannot reach it
  name it in their commit vote; a site most of the others cannot reach is excluded and stops
  alone, with one line (see docs/reliability.md). For this fault the launcher runs each site
  in a network namespace of its own, joined to the others by a bridge (root and iproute2);
- attacks, acted out by a bad site on every contribution it sends from the step on (from step
  1 without ``@STEP``), after its own finiteness check and before encoding, so the others meet
  exactly what a faulty or malicious site would send (``aggregation=`` chooses the defence):
  ``signflip:1@20`` sends the negated pseudo-gradient; ``scale:1x1000`` sends it times the
  factor; ``noise:1x2`` adds Gaussian noise of 2x its norm; ``zero:1`` sends zeros (a free
  rider); ``nan:1`` sends NaN, flagged valid (a silent fault that passes a dense mean);
  ``drift:1`` sends, at its own contribution's norm (times the factor), the direction that
  shrinks every weight toward 0 (the global copy), on a fixed half of the entries of its own:
  an attack that accumulates over a run rather than spoiling one sync. On top-k it picks the
  largest weights of its half, the same indices every sync, which honest sites seldom pick
  and other drifting sites do not: it spends its budget where nobody else sends.
  ``collude:1`` is ``drift`` on every entry, so all colluders pick the same indices and vouch
  for each other;
- insiders, acted out by a site that holds the run's secret, from the step on (from step 1
  without ``@STEP``): ``liar:2@30`` reports a false checksum of its global copy at every replica
  check (a liar, or a copy whose memory flipped a bit); ``dissent:2@30`` votes every sync's
  commit failed; ``accuse:2@30`` votes every sync's commit failed and names the lowest other
  member's payload as undecodable; ``ender:2@30`` tells its lighthouse's front at step 30 that
  it finished the run (the sealed word a site that finished sends: with a run secret only) and
  trains on. None of them may stop the run: the others exclude it (an ender the front refuses
  as finished);
- ``slow:1x3``   site 1 computes 3x slower (from step 1, or ``slow:1@40x3`` from step 40): after
  each inner step it sleeps twice that step's compute time. Sleeping frees the CPU, so on a
  machine with fewer cores than sites the others do not slow down with it;
- ``slowlink:1x0.2`` site 1's link is slow (from step 1, or ``@STEP``): each collective of its
  training traffic waits 0.2 s before it starts, as a link of long latency would (shaped links
  of a given rate, with ``tc``, are ``site_link=``).

A fault acts on the real process, so the rest of the run meets it exactly as it would meet one
from outside.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from lowcomm.errors import ConfigError

# on what a site sends (see attack; copy and alie forge it from the others': see forge)
ATTACKS = ("signflip", "scale", "noise", "zero", "nan", "copy", "alie", "drift", "collude")
INSIDERS = ("liar", "dissent", "accuse", "ender")  # a member's lies in its votes, checks, word
KINDS = (
    "kill",
    "hang",
    "pause",
    "join",
    "add",
    "slow",
    "corrupt",
    "healer",
    "collective",
    "stall",
    "lighthouse",
    "link",
    "slowlink",
    *ATTACKS,
    *INSIDERS,
)
_FAULT = re.compile(r"^(?P<kind>[a-z]+):(?P<site>\d+)(@(?P<step>\d+))?(x(?P<factor>[0-9.]+))?$")


@dataclass(frozen=True)
class Fault:
    """One fault: what happens to which site, from which inner step (and how strongly)."""

    kind: str
    site: int
    step: int | None = None
    factor: float | None = None

    def __str__(self) -> str:
        at = f"@{self.step}" if self.step is not None else ""
        by = f"x{self.factor:g}" if self.factor is not None else ""
        return f"{self.kind}:{self.site}{at}{by}"


def parse_faults(text: str, sites: int, steps: int) -> list[Fault]:
    """The faults of ``text`` (empty: none), checked against the run's sites and steps."""
    out = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        m = _FAULT.match(item)
        if m is None:
            raise ConfigError(
                f"--faults: cannot read {item!r}: write KIND:SITE[@STEP][xFACTOR], e.g. kill:2@35"
            )
        kind, site = m["kind"], int(m["site"])
        if kind not in KINDS:
            raise ConfigError(
                f"--faults: unknown kind {kind!r} in {item!r}: use {', '.join(KINDS)}"
            )
        if kind != "add" and not 0 <= site < sites:
            raise ConfigError(f"--faults: {item!r} names site {site}, the run has 0..{sites - 1}")
        out.append(_checked(kind, site, m["step"], m["factor"], item, steps))
    new = sorted(f.site for f in out if f.kind == "add")
    if new != list(range(sites, sites + len(new))):
        raise ConfigError(
            f"--faults: add names new sites, numbered on from the run's {sites}: "
            f"add:{sites}@STEP, add:{sites + 1}@STEP, ... (got {new})"
        )
    for f in out:
        if f.kind == "join" and not any(
            k.kind == "kill" and k.site == f.site and k.step < f.step for k in out
        ):
            raise ConfigError(
                f"--faults: {f} restarts a killed site: add kill:{f.site}@STEP with STEP < {f.step}"
            )
    return out


def _checked(
    kind: str, site: int, step: str | None, factor: str | None, item: str, steps: int
) -> Fault:
    """One fault whose step and factor suit its kind (``slow`` takes a factor > 1, ``pause``
    and ``lighthouse`` a number of seconds)."""
    if step is None and (kind in ("slow", "slowlink") or kind in ATTACKS or kind in INSIDERS):
        step = "1"
    if step is None or not 1 <= int(step) <= steps:
        raise ConfigError(f"--faults: {item!r} needs @STEP with 1 <= STEP <= {steps}")
    if kind in ("pause", "lighthouse", "link", "slowlink"):
        if factor is None or float(factor) <= 0:
            what = {
                "pause": "it is stopped",
                "lighthouse": "the lighthouse is away",
                "link": "its data plane is cut",
                "slowlink": "each of its collectives waits",
            }[kind]
            raise ConfigError(f"--faults: {item!r} needs xSECONDS > 0 (how long {what})")
        return Fault(kind, site, int(step), float(factor))
    if kind in ("scale", "noise"):
        if factor is None or float(factor) <= 0:
            what = "multiplied by" if kind == "scale" else "noised by, times their norm"
            raise ConfigError(f"--faults: {item!r} needs xFACTOR > 0 (what its sends are {what})")
        return Fault(kind, site, int(step), float(factor))
    if kind in ("drift", "collude"):  # x1 unless told: a typical contribution's norm
        if factor is not None and float(factor) <= 0:
            raise ConfigError(f"--faults: {item!r} needs xFACTOR > 0 (times its own norm)")
        return Fault(kind, site, int(step), float(factor) if factor is not None else None)
    if kind != "slow":
        if factor is not None:
            raise ConfigError(f"--faults: {kind} takes no xFACTOR ({item!r})")
        return Fault(kind, site, int(step))
    if factor is None or float(factor) <= 1:
        raise ConfigError(f"--faults: {item!r} needs xFACTOR > 1 (how many times slower)")
    return Fault(kind, site, int(step), float(factor))


def pace(faults: list[Fault], site: int, step: int, compute_s: float) -> None:
    """After inner step ``step`` of ``site`` took ``compute_s``: a ``slow:`` fault sleeps it
    (factor - 1) times that long."""
    factor = max(
        (
            f.factor or 1.0
            for f in faults
            if f.kind == "slow" and f.site == site and step >= (f.step or 1)
        ),
        default=1.0,
    )
    if factor > 1:
        time.sleep((factor - 1) * compute_s)


def joins(faults: list[Fault]) -> dict[int, int]:
    """Site -> the step from which it joins again after it was killed (``join:`` faults)."""
    return {f.site: int(f.step or 0) for f in faults if f.kind == "join"}


def adds(faults: list[Fault]) -> dict[int, int]:
    """New site -> the step from which it joins the run (``add:`` faults)."""
    return {f.site: int(f.step or 0) for f in faults if f.kind == "add"}


LIGHTHOUSE_FAULT = ".fault-lighthouse"


def lighthouse_down(faults: list[Fault]) -> bool:
    """Whether ``faults`` kill the lighthouse (``lighthouse:``)."""
    return any(f.kind == "lighthouse" for f in faults)


def links(faults: list[Fault]) -> bool:
    """Whether ``faults`` cut a site's data plane (``link:``: the sites run in namespaces)."""
    return any(f.kind == "link" for f in faults)


def cut_link(seconds: float) -> None:
    """Drop every packet this site sends but those to the lighthouse, for ``seconds`` (then a
    helper process it starts puts the interface back). Needs the namespace the launcher made
    for this site: its interface is ``GLOO_SOCKET_IFNAME``, the lighthouse ``LOWCOMM_LIGHTHOUSE``.
    htb classes, a filter and an empty queue: kernels without tc's drop action have these."""
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    keep = urlparse(os.environ["LOWCOMM_LIGHTHOUSE"]).hostname
    tc = f"tc qdisc replace dev {dev} root handle 1: htb default 20"
    for cmd in (
        f"tc class add dev {dev} parent 1: classid 1:10 htb rate 10gbit",
        f"tc class add dev {dev} parent 1: classid 1:20 htb rate 10gbit",
        f"tc qdisc add dev {dev} parent 1:20 handle 20: pfifo limit 0",  # holds nothing: drops
        f"tc filter add dev {dev} parent 1: pref 1 protocol ip u32 match ip dst {keep}/32 "
        f"flowid 1:10",
        f"tc filter add dev {dev} parent 1: pref 2 protocol arp u32 match u32 0 0 flowid 1:10",
    ):
        tc += f" && {cmd}"
    done = subprocess.run(["sh", "-c", tc], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"--faults link: tc could not cut {dev}: {done.stderr.strip()}")
    back = f"tc qdisc del dev {dev} root"
    if os.environ.get("LOWCOMM_UPLINK"):  # the shaping the cut replaced, put back
        back += f" && tc qdisc add dev {dev} root tbf {os.environ['LOWCOMM_UPLINK']}"
    subprocess.Popen(["sh", "-c", f"sleep {seconds:g}; {back}"])


def decoded(faults: list[Fault]) -> list[Fault]:
    """The faults that need the payloads decoded by their receivers (``corrupt:``)."""
    return [f for f in faults if f.kind == "corrupt"]


def paused(faults: list[Fault], site: int) -> bool:
    """Whether ``site`` has a ``pause:`` fault: stopped, it is coming back (a hang is not)."""
    return any(f.kind == "pause" and f.site == site for f in faults)


@dataclass(frozen=True)
class Staged:
    """What the local launcher stages for one site process of a run with ``--faults``: the
    faults it acts out, a standby joiner's gate, and a ``link:`` fault's network namespace.
    Nothing of it exists in a deployed site (one launched per site)."""

    faults: tuple[Fault, ...] = ()
    gate: object = None  # a joiner started on standby: a multiprocessing Event set to let it in
    netns: str = ""  # the network namespace this site runs in (a ``link:`` fault), and ...
    addr: str = ""  # ... its address there
    uplink: str = ""  # ... and its uplink's tbf settings (a ``link:`` fault puts them back)


#: a site with nothing staged
NOT_STAGED = Staged()
