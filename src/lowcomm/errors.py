"""Every error lowcomm raises for users to catch derives from :class:`LowCommError`.

Kept free of torch so that light modules (config, schedule, the simulator) can import it.
"""

from __future__ import annotations


class LowCommError(Exception):
    """Base of lowcomm's user-facing errors: ``except lowcomm.LowCommError`` catches them all."""


class ConfigError(LowCommError, ValueError):
    """A configuration that cannot work; the message names the problem and the fix."""


class NonFiniteError(LowCommError, RuntimeError):
    """Too many syncs in a row had a worker with a non-finite pseudo-gradient."""


class ReplicaMismatchError(LowCommError, RuntimeError):
    """The global parameters differ between workers: the run cannot continue as one model."""


class PayloadError(LowCommError, ValueError):
    """A payload failed validation on decode (peers' payloads are untrusted input).

    ``sender``: the group rank whose payload it was, when known. The same bytes fail the same
    way on every retry, so an elastic run excludes that sender instead of retrying it."""

    def __init__(self, message: str, sender: int | None = None) -> None:
        super().__init__(message)
        self.sender = sender


class CheckpointError(LowCommError, RuntimeError):
    """A checkpoint (or one of its files) is missing, incomplete or corrupt."""


class MembershipError(LowCommError, RuntimeError):
    """This site cannot go on with the run: it was left out, or too few sites remain."""


class SiteLeft(Exception):
    """This site left the run on purpose, at a sync (a replay leaving where the recorded run's
    site left): not a failure. It unwinds the site's trainer, which ends the process with exit
    code 0; the others go on without it from the next sync."""
