"""The training methods, one :class:`Strategy` object each, registered once under its name.

Each method is one module of this package (its preset, its refusals, what the trainer and the
simulator need of it); importing the package imports every module, so a new method is one new
file. Imports without torch.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import REGISTRY, Strategy, elastic_names, find, get, names, register

# the order of REGISTRY (and so of --help and reports): per-step, then our outer loops (a
# plugin's methods, a peer's, come after them)
_ORDER = ("ddp", "loco", "diloco", "streaming", "sparseloco", "co2")
for _mod in sorted(
    (m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"),
    key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n),
):
    importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["REGISTRY", "Strategy", "elastic_names", "find", "get", "names", "register"]
