"""Admission by secret: only sites that hold the run's secret take part in it.

The secret is read from a file on each site's machine (``secret_file=PATH``) or from the
environment (``LOWCOMM_SECRET``); never from a command line, and it is written nowhere (not in
``elastic.json``, a summary, a checkpoint or the settings' fingerprint). Each site derives the
run's key from it, HKDF-SHA256 with the run id as its context, so a secret shared by two runs
still gives each its own key.

What carries a MAC under that key (HMAC-SHA256):

- every quorum request's data, which names the run, the sync's tag, the phase (the sync or its
  commit vote), the attempt (generation), the sender (site and process) and the lighthouse epoch;
  a request without a valid one is no member's, for every member alike, and is counted;
- every hint of quorum rounds (a site's arrival at a sync, its pace, a sync closed), bound to the
  hint's key, which names the sync and the sender: a forged one is read as absent;
- the digest of the state a heal hands over, bound to the sync, the attempt and the member;
- every heartbeat, which names the run, the process and its stamp (a keyed front forwards
  only those: a stranger's beats cannot keep a dead site "alive").
- (not a MAC carried, a MAC used) each group's store prefix, so a process without the key cannot
  tell where a group's keys will be.


The lighthouse itself has no authentication (torchft's); a keyed run's serves behind an
authenticating front (:mod:`.front`) that forwards only sealed requests and beats, and proves
it holds the run's key: a keyed site refuses a lighthouse that cannot (an open one, where a
stranger could heartbeat under a dead site's name or ask under a live one's) before it starts.
Nothing a stranger sends decides anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .messages import Beat, End, Request, unsealed

log = logging.getLogger("lowcomm")

SECRET_ENV = "LOWCOMM_SECRET"
_SALT = b"lowcomm run key v1"


def read_secret(secret_file: str = "") -> bytes | None:
    """The run secret: ``secret_file``'s bytes (surrounding whitespace stripped), else
    ``$LOWCOMM_SECRET``; None when neither is set (a run without admission)."""
    if secret_file:
        path = Path(secret_file).expanduser()
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"secret_file={secret_file}: cannot read it ({e.strerror})") from None
        if not secret:
            raise ConfigError(f"secret_file={secret_file} is empty: write the run's secret in it")
        return secret
    env = os.environ.get(SECRET_ENV, "").strip()
    return env.encode() or None


def run_key(secret: bytes, run_id: str) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``secret``, with the run id as its info: 32 bytes."""
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, run_id.encode() + b"\x01", hashlib.sha256).digest()


class Admission:
    """This site's MACs: it seals what it sends and screens what it reads (see the module).
    Without a secret it seals nothing and reads only requests sealed by nobody."""

    def __init__(self, site: int, run_id: str, secret: bytes | None, sites: int = 1) -> None:
        self.site, self.run_id, self.sites = site, run_id, sites  # sites: the run's at start
        self._key = run_key(secret, run_id) if secret is not None else None
        # requests unreadable or without a valid MAC (each time read; counted by the reader
        # too), and hints without one (each value once)
        self.ignored = 0
        self._told: set[tuple[int, str]] = set()  # (site, process) already warned about
        self._forged: set[tuple[str, bytes]] = set()  # hints (key, stored bytes) ignored
        # requests that claimed this run's membership and failed: how many, by sealed or not
        self._claimed: dict[bool, int] = {}

    @property
    def keyed(self) -> bool:
        """Whether this site holds a run secret."""
        return self._key is not None

    def mac(self, *fields: Any) -> str:
        """The MAC of ``fields`` under the run's key (hex); '' without a secret."""
        if self._key is None:
            return ""
        message = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def valid(self, mac: Any, *fields: Any) -> bool:
        """Whether ``mac`` is the MAC of ``fields`` (always, without a secret)."""
        if self._key is None:
            return True
        return isinstance(mac, str) and hmac.compare_digest(mac, self.mac(*fields))

    def bind(self, prefix: str) -> str:
        """A group's store prefix bound to the run's key: a process without it cannot compute
        where a group's keys (gloo's rendezvous entries included) are, so it cannot write them
        in advance. Unchanged without a secret."""
        return prefix if self._key is None else f"{self.mac('store', prefix)[:32]}/"

    # -- quorum requests -------------------------------------------------------------------------
    def seal(self, data: dict[str, Any]) -> dict[str, Any]:
        """A quorum request's ``data`` with its MAC (over every field) added."""
        if self._key is None:
            return data
        return {**data, "mac": self.mac("request", unsealed(data))}

    def screen(self, data: list[Request]) -> list[Request]:
        """The requests of ``data`` with a valid MAC (without a secret: those without one).
        The rest are counted, named once, and reach no decision: a request that fails is
        nobody's, whatever it claims. What they claimed of this run is only remembered, to
        say why this site was not let in if its own wait for the run runs out
        (:meth:`explain`): bytes nobody can authenticate never stop a site by themselves."""
        good = [d for d in data if self._sealed_well(d)]
        for d in data:
            if d in good:
                continue
            self.ignored += 1
            if d.run == self.run_id and not d.join:  # they claim to be the run's members
                self._claimed[d.sealed] = self._claimed.get(d.sealed, 0) + 1
            who = (d.site, d.inc)
            if who not in self._told:
                self._told.add(who)
                log.warning(
                    "site %d: a quorum request from site %d without a valid MAC (no run "
                    "secret, another one, or another run) was ignored: not a member",
                    self.site,
                    who[0],
                )
        return good

    def explain(self) -> str:
        """Why a site whose wait for the run ran out may not have been let in: requests that
        claimed this run failed its MAC check (its secret may differ from the run's; or a
        stranger sent them). '' when none did."""
        if not self._claimed:
            return ""
        count = sum(self._claimed.values())
        if self._key is None:
            fix = (
                f"the run's sites may hold a run secret and this one none: if so, give it the "
                f"run's secret (secret_file= or {SECRET_ENV})"
            )
        elif not self._claimed.get(True):
            fix = (
                f"the run's sites may hold no run secret and this one does: if so, start it "
                f"without secret_file= and {SECRET_ENV}, as the others"
            )
        else:
            fix = (
                "they carry no valid MAC under this site's secret (another secret, or another "
                "run id): if they are the run's, give this site the run's secret"
            )
        return f"; {count} requests claiming run {self.run_id} were ignored: {fix}"

    def _sealed_well(self, d: Request) -> bool:
        """Whether ``d`` carries a valid MAC over the fields it was sent with (none without
        a secret)."""
        if self._key is None:
            return not d.sealed
        return self.valid(d.mac, "request", d.signed)

    # -- heartbeats and the front's proof ---------------------------------------------------
    def beat(self, name: str, inc: str, seq: int) -> bytes:
        """The seal of a heartbeat under ``name`` from process ``inc``, stamped ``seq`` (a keyed
        front forwards only sealed beats: see .front); b'' without a secret."""
        if self._key is None:
            return b""
        beat = Beat(self.run_id, inc, seq)
        return Beat(**{**beat.signed, "mac": self.mac("beat", name, beat.signed)}).to_wire()

    def beat_valid(self, name: str, beat: Beat) -> bool:
        """Whether ``beat``'s MAC is valid for a beat under ``name``."""
        return self.valid(beat.mac, "beat", name, beat.signed)

    def end(self, inc: str, seq: int, tag: str) -> bytes:
        """The sealed word that this site (process ``inc``) finished the run after ``tag``,
        stamped ``seq`` (see .front); b'' without a secret."""
        if self._key is None:
            return b""
        end = End(self.run_id, self.site, inc, seq, tag)
        return End(**{**end.signed, "mac": self.mac("end", end.signed)}).to_wire()

    def end_valid(self, end: End) -> bool:
        """Whether ``end``'s MAC is valid."""
        return self.valid(end.mac, "end", end.signed)

    def proof(self, nonce: str) -> str:
        """What a keyed front answers a site's ``nonce`` with: its MAC under the run's key."""
        return self.mac("front", nonce)

    # -- hints of quorum rounds ------------------------------------------------------------------
    def hint(self, key: str, value: str) -> str:
        """The stored form of hint ``key`` = ``value``: the value and its MAC."""
        return value if self._key is None else f"{value}|{self.mac('hint', key, value)}"

    def read_hint(self, key: str, raw: bytes) -> str | None:
        """Hint ``key``'s value from its stored bytes; None when its MAC is not valid."""
        text = raw.decode(errors="replace")
        if self._key is None:
            return text
        value, _, mac = text.rpartition("|")
        if self.valid(mac, "hint", key, value):
            return value
        if (key, raw) not in self._forged:  # polled again and again: counted once
            self._forged.add((key, raw))
            self.ignored += 1
            log.warning("site %d: round hint %r without a valid MAC was ignored", self.site, key)
        return None
