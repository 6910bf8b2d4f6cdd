"""lowcomm's lab: what measures, shapes and attacks the core, kept apart from it.

It plugs into the core as any package may (:mod:`lowcomm.plugins`): :func:`register`, the
``lowcomm.plugins`` entry point of this install, adds its commands, strategies, codecs, DDP
hooks and its extension of the trainer (faults on purpose, shaped links between sites) to the
core's registries. The core imports nothing of it.
"""

from __future__ import annotations


def register() -> None:
    """Add the lab to the core's registries (called once per process, by the core)."""
    from ..faults import extension  # noqa: F401  (registers the trainer's Lab extension)
