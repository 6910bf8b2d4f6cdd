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
- the digest of the state a heal hands over, bound to the sync, the attempt and the member.

The lighthouse itself has no authentication (torchft's): a process that heartbeats under a
site's name can keep a dead site "alive", a denial of service this does not prevent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MembershipError
from .messages import Request, unsealed

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
        self.ignored = 0  # requests (each time read) and hints (each value once) without a MAC
        self._told: set[tuple[int, str]] = set()  # (site, process) already warned about
        self._forged: set[tuple[str, bytes]] = set()  # hints (key, stored bytes) ignored

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

    # -- quorum requests -------------------------------------------------------------------------
    def seal(self, data: dict[str, Any]) -> dict[str, Any]:
        """A quorum request's ``data`` with its MAC (over every field) added."""
        if self._key is None:
            return data
        return {**data, "mac": self.mac("request", unsealed(data))}

    def screen(self, data: list[Request], entering: str = "") -> list[Request]:
        """The requests of ``data`` with a valid MAC (without a secret: those without one).
        The rest are counted and named once. ``entering``: "start" or "join" while this site
        is starting or joining; when the run's requests say that this site is the one without
        the run's secret (:meth:`odd_one_out`), it stops with one line and the others go on."""
        good = [d for d in data if self._sealed_well(d)]
        bad = [d for d in data if not self._sealed_well(d)]
        for d in bad:
            self.ignored += 1
            who = (d.site, d.inc)
            if who not in self._told:
                self._told.add(who)
                log.warning(
                    "site %d: a quorum request from site %d without a valid MAC (no run "
                    "secret, another one, or another run) was ignored: not a member",
                    self.site,
                    who[0],
                )
        if entering and self.odd_one_out(good, bad, entering == "join"):
            raise MembershipError(self._refusal(bad))
        return good

    def odd_one_out(self, good: list[Request], bad: list[Request], joining: bool) -> bool:
        """Whether this entering site, not the others, lacks the run's secret. Only requests of
        this run id count (a lighthouse may serve other runs), and only the run's members or
        starting sites, never joiners (anyone may ask to join). A joiner: a member asked and
        none passed. A starting site: a majority of the run's starting sites failed (a
        stranger alone with it proves nothing; in a run of two, neither can tell which secret
        is wrong: each names the other and waits)."""
        failed = [d for d in bad if d.run == self.run_id and not d.join]
        if joining:
            members = [d for d in good if d.site != self.site and not d.join]
            return bool(failed) and not members
        return len(failed) >= self.sites // 2 + 1

    def _sealed_well(self, d: Request) -> bool:
        """Whether ``d`` carries a valid MAC over the fields it was sent with (none without
        a secret)."""
        if self._key is None:
            return not d.sealed
        return self.valid(d.mac, "request", d.signed)

    def _refusal(self, bad: list[Request]) -> str:
        if self._key is None:
            return (
                f"site {self.site} was refused by the run: its sites hold a run secret and this "
                f"one has none: give it the run's secret (secret_file= or {SECRET_ENV})"
            )
        if not any(d.sealed for d in bad):
            return (
                f"site {self.site} was refused by the run: its sites hold no run secret and this "
                f"one does: start it without secret_file= and {SECRET_ENV}, as the others"
            )
        return (
            f"site {self.site} was refused by the run: the others' requests carry no valid MAC "
            f"under this site's secret (another secret, or another run id): give it the run's "
            f"secret"
        )

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
