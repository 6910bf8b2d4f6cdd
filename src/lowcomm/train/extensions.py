"""Extensions of the reference trainer: what another package adds to the runs of ``lowcomm
train`` (lowcomm's lab: faults on purpose, shaped links between sites).

An extension is a frozen dataclass of its own settings, registered once with :func:`register`:
its fields are config keys as the core's are (``key=value``, ``--config FILE.toml``, ``--help``,
one node of the settings tree), and a run whose settings give any of them holds an instance
(``RunSpec.extensions``). Its methods are called at fixed points of the run: before any worker
starts (:meth:`Extension.check`), by the local launcher of an elastic run
(:meth:`Extension.plan`), and in each worker process (:meth:`Extension.callbacks`). The trainer
knows nothing else of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .. import plugins
from ..config import register_node
from ..errors import ConfigError

if TYPE_CHECKING:  # (the spec holds extensions without importing this module)
    from .callbacks import TrainerCallback
    from .elastic import SitePlan
    from .spec import RunSpec

EXTENSIONS: dict[str, type[Extension]] = {}


@dataclass(frozen=True)
class Extension:
    """A part that extends the trainer's runs; subclasses add their settings as fields."""

    name: ClassVar[str] = ""

    def check(self, spec: RunSpec, workers: int) -> None:
        """Refuse, in one line, what this run cannot do with these settings (``workers``: how
        many start it), before any worker starts."""

    def plan(self, spec: RunSpec, workers: int) -> SitePlan | None:
        """What the local launcher of an elastic run must start or set up for these settings
        (None: nothing)."""
        return None

    def callbacks(self, spec: RunSpec, site: int, starting: int) -> list[TrainerCallback]:
        """The callbacks of one worker process: site (or worker) ``site`` of a run that
        ``starting`` sites began."""
        return []


def register(cls: type[Extension]) -> type[Extension]:
    """Class decorator: the extension's one entry under ``cls.name``, its fields config keys."""
    if not cls.name or EXTENSIONS.get(cls.name, cls) is not cls:
        raise ValueError(f"extension name {cls.name!r} is empty or taken")
    register_node(cls.name, cls)
    EXTENSIONS[cls.name] = cls
    return cls


def get(name: str) -> type[Extension]:
    """The extension registered as ``name`` (the installed plugins looked at if need be)."""
    if name not in EXTENSIONS:
        plugins.load()
    if name not in EXTENSIONS:
        raise ConfigError(
            f"this run's settings name an extension of lowcomm, {name!r}, that is not "
            f"installed here: install the package that provides it (lowcomm's lab comes with "
            f"lowcomm itself)"
        )
    return EXTENSIONS[name]
