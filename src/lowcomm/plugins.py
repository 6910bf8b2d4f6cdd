"""Packages that extend lowcomm, found where they are installed: each declares one function
under the entry point group ``lowcomm.plugins`` (in its ``pyproject.toml``), which registers
what it adds with the core's own registries: commands of the ``lowcomm`` command line
(:func:`lowcomm.cli.register_command`), strategies (:func:`lowcomm.strategies.register`),
codecs (:func:`lowcomm.codecs.register`), DDP comm hooks
(:func:`lowcomm.hooks.register_ddp_hook`) and extensions of the trainer
(:func:`lowcomm.train.extensions.register`).

The core loads them only when it looks for something it does not hold itself (a command, a
strategy, a setting or a codec of that name) or lists everything (``--help``), once per
process: a run of the core's own methods never imports a plugin. lowcomm's lab (benchmarks,
shaped links, faults and attacks, the torchft peer) is such a package, installed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

GROUP = "lowcomm.plugins"

_loaded = False
_added: list[Callable[[], None]] = []


def load() -> bool:
    """Run every plugin's registration once per process (installed ones, then those
    :func:`add` was given); whether this call ran any (False: done already)."""
    global _loaded
    if _loaded:
        return False
    _loaded = True
    ran = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        register = ep.load()
        register()
        ran.append(register)
    for register in _added:
        if register not in ran:  # an installed plugin also added by hand: once
            register()
    return True


def add(register: Callable[[], None]) -> None:
    """A plugin's registration for this process, from a source tree that is not installed
    (``python -m lowcomm.lab``): run now if plugins were loaded already, else with them."""
    if register in _added:
        return
    _added.append(register)
    if _loaded:
        register()
