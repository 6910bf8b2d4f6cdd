"""The protocol's messages as typed values. A site's quorum request (its commit vote is one,
in phase ``commit``) comes off the wire once, through :meth:`Request.from_wire`, which reads
and checks every field; the decisions (:mod:`.decide`), the membership and the runner read its
typed fields, never the wire's keys. A request that fails ``from_wire`` is counted and reaches
no decision, for every member alike (the lighthouse hands every member the same requests).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

#: where malformed requests are told: a site warns of them; a lighthouse's process silences
#: this logger alone (junk anyone may send it is no news there), not the rest of lowcomm's
REQUESTS_LOG = "lowcomm.requests"
log = logging.getLogger(REQUESTS_LOG)


def quiet_junk() -> None:
    """In a lighthouse's process: malformed requests (anyone may send them) go untold, while
    lowcomm's other warnings still reach its output."""
    logging.getLogger(REQUESTS_LOG).setLevel(logging.ERROR)


#: the fields every request carries, and their types: one missing or of another type drops it
REQUIRED: dict[str, type] = {"site": int, "tag": str, "phase": str, "gen": int, "join_from": int}


#: what a run id may be (it goes into names at the lighthouse and into store keys)
RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_run_id(run_id: str) -> None:
    """Refuse a run id that cannot name a run (see :data:`RUN_ID`), with one line."""
    if not RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run_id={run_id}: use 1 to 64 letters, digits, '.', '_' or '-'")


def replica_name(run_id: str, site: int) -> str:
    """A site's name at the lighthouse: its run's id and its number (the lighthouse keeps the
    last request per name, so two runs on one lighthouse take no name of each other's)."""
    return f"{run_id}/site{site:04d}"


def as_int(value: Any) -> int:
    """A reported number, or 0 (a request without it, or a malformed one)."""
    return value if is_int(value) else 0


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (a bool is not: JSON's true is no site number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _text(value: Any) -> str | None:
    """A reported string, or None (absent, or of another type: equal to no string)."""
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Request:
    """One site's request in a quorum, as every member reads it."""

    site: int
    tag: str  # the sync it asks for (``sync@35``, ``flags@90``, ``start``, ``join``)
    phase: str = "sync"  # its collectives ("sync"), their commit vote ("commit"), "join"
    gen: int = 0  # the attempt it runs (its failed commits so far)
    join_from: int = 0  # a joiner: the step from which it may join
    ok: bool = False  # a vote: it completed the attempt's collectives
    join: bool = False  # a joiner's request
    ready: bool = False  # it offers the run's state to a joiner at this sync
    enter: bool = False  # launched on its own: it starts with the run or joins it
    fp: str | None = None  # the fingerprint of its run's settings
    run: str | None = None  # its run id
    store: str = ""  # the address of the store it hosts
    inc: str = ""  # its process, among the site's restarts
    join_at: str = ""  # a joiner (a replay's, or one asking back in): exactly this sync
    ranks: int = 1  # the ranks of its site
    lh: int = 0  # the lighthouse epoch it has seen
    name: str = ""  # the name it asked under at the lighthouse (its MAC covers it)
    seq: int = 0  # when it was sent (ns): of two requests of one site, the newer is the site's
    blame: int | None = None  # a vote: the site whose payload it refused
    why: str = ""  # ... and what was wrong with it
    unreached: tuple[int, ...] = ()  # a vote: the sites it could not reach
    mac: Any = field(default=None, compare=False)  # its MAC under the run's key, if any
    sealed: bool = False  # whether it came with one
    # the fields as sent, but its MAC: what the MAC covers (admission.py)
    signed: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_wire(cls, raw: Any, replica_id: str | None = None) -> Request | None:
        """The request in a participant's ``raw`` data, or None when it is malformed (a
        required field missing or of the wrong type, a joiner's sync that is no string) or
        names another site than the participant it came in as (``replica_id``: a request
        copied under another name, sealed or not)."""
        if not isinstance(raw, dict):  # junk any process may send the lighthouse
            log.warning("a quorum request that is no mapping (%s) was ignored", type(raw).__name__)
            return None
        d = dict(raw)
        for key, kind in REQUIRED.items():
            value = d.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                log.warning("a quorum request with a malformed %r (%r) was ignored", key, value)
                return None
        named = replica_name(_text(d.get("run")) or "", d["site"])
        # the name it came in under: the one it says it asked under (sealed with the rest, so a
        # copy under another name is nobody's), its run's for its site, with a suffix when its
        # name was taken (see .reading)
        came = replica_id is not None and (
            replica_id != d.get("name") or replica_id.split("/")[:2] != named.split("/")
        )
        if d["site"] < 0 or came:
            return None
        join_at = d.get("join_at") or ""
        if not isinstance(join_at, str):
            log.warning("a quorum request with a malformed 'join_at' (%r) was ignored", join_at)
            return None
        blame = d.get("blame")
        said = d.get("unreached")
        return cls(
            site=d["site"], tag=d["tag"], phase=d["phase"], gen=d["gen"],
            join_from=d["join_from"], ok=d.get("ok") is True, join=bool(d.get("join")),
            ready=bool(d.get("ready")), enter=bool(d.get("enter")), fp=_text(d.get("fp")),
            run=_text(d.get("run")), store=str(d.get("store", "")), inc=str(d.get("inc", "")),
            join_at=join_at, ranks=as_int(d.get("ranks", 1)), lh=as_int(d.get("lh")),
            name=str(d.get("name", "")), seq=as_int(d.get("seq")),
            blame=blame if is_int(blame) else None, why=str(d.get("why", "")),
            unreached=tuple(s for s in (said if isinstance(said, list) else ()) if is_int(s)),
            mac=d.get("mac"), sealed="mac" in d, signed=unsealed(d),
        )  # fmt: skip


@dataclass(frozen=True)
class Beat:
    """A keyed site's heartbeat seal (see .front): its run, its process, the beat's stamp
    (nanoseconds, never back) and their MAC with the name it beats under."""

    run: str
    inc: str
    seq: int
    mac: str = ""

    @property
    def signed(self) -> dict[str, Any]:
        """The fields the MAC covers (beside the name)."""
        return {"run": self.run, "inc": self.inc, "seq": self.seq}

    def to_wire(self) -> bytes:
        """The seal's bytes (a heartbeat request's field 2)."""
        return _wire({**self.signed, "mac": self.mac})

    @classmethod
    def from_wire(cls, raw: bytes) -> Beat | None:
        """The seal in ``raw``, every field of its type; None for anything else."""
        d = _typed(raw, {"run": str, "inc": str, "seq": int, "mac": str})
        return cls(**d) if d is not None else None


@dataclass(frozen=True)
class End:
    """A keyed site's word to its front that it finished the run (see .front): its run, its
    site and process, the last sync it took part in, a stamp (nanoseconds) and their MAC."""

    run: str
    site: int
    inc: str
    seq: int
    tag: str
    mac: str = ""

    @property
    def signed(self) -> dict[str, Any]:
        """The fields the MAC covers."""
        return {
            "run": self.run,
            "site": self.site,
            "inc": self.inc,
            "seq": self.seq,
            "tag": self.tag,
        }

    def to_wire(self) -> bytes:
        """The message's bytes (a ``lowcomm.Front/End`` request)."""
        return _wire({**self.signed, "mac": self.mac})

    @classmethod
    def from_wire(cls, raw: bytes) -> End | None:
        """The message in ``raw``, every field of its type; None for anything else."""
        kinds = {"run": str, "site": int, "inc": str, "seq": int, "tag": str, "mac": str}
        d = _typed(raw, kinds)
        return cls(**{**d, "tag": d["tag"][:64]}) if d is not None else None


def _wire(fields: dict[str, Any]) -> bytes:
    """A message's bytes: its fields as compact JSON."""
    return json.dumps(fields, separators=(",", ":")).encode()


def _typed(raw: bytes, kinds: dict[str, type]) -> dict[str, Any] | None:
    """The fields ``kinds`` names from the JSON mapping in ``raw``, each of its type (an int
    that is no bool; ``run`` a run id); None for anything else."""
    try:
        d = json.loads(raw.decode(errors="replace")) if raw else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict):
        return None
    out = {k: d.get(k) for k in kinds}
    if any(type(v) is not kinds[k] for k, v in out.items()):
        return None
    return out if RUN_ID.fullmatch(out.get("run", "")) else None


def proof_request(raw: bytes) -> tuple[str, str] | None:
    """(run, nonce) of a keyed site's ``lowcomm.Front/Prove`` request; None if malformed."""
    try:
        d = json.loads(raw.decode(errors="replace"))
    except (ValueError, RecursionError):
        return None
    run, nonce = (d.get("run"), d.get("nonce")) if isinstance(d, dict) else (None, None)
    if not isinstance(run, str) or not RUN_ID.fullmatch(run) or not isinstance(nonce, str):
        return None
    return run, nonce[:64]


def proof_of(run: str, nonce: str) -> bytes:
    """The bytes of a ``Prove`` request for ``run`` with ``nonce``."""
    return json.dumps({"run": run, "nonce": nonce}).encode()


def unsealed(data: dict[str, Any]) -> dict[str, Any]:
    """A request's fields without its MAC: what the MAC covers."""
    return {k: v for k, v in data.items() if k != "mac"}
