"""What a training method is, for everything outside the engine: a :class:`Strategy` object,
registered once under its name.

The CLI, the config checks, the trainer, the elastic launcher, the reports and the simulator ask
the strategy object; none of them compares a strategy's name to a string. This module imports
without torch (the simulator and the config checks run without it): what needs torch is imported
inside the method that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .. import plugins
from ..config import ConfigError, SyncConfig
from ..config.checks import alpha_mixes

if TYPE_CHECKING:
    from ..config import MembershipConfig, TrainConfig

REGISTRY: dict[str, Strategy] = {}
"""Every strategy by name, in the order registered (per-step, outer, peers)."""


class Strategy:
    """A training method: its settings, its refusals, and what the trainer and simulator need.

    Subclasses set the class attributes and override the ``check_*`` methods that refuse more;
    :func:`register` makes one instance the method's single entry.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    """One line for ``--help`` and the docs."""
    settings: ClassVar[Mapping[str, Any]] = {}
    """The SyncConfig fields that differ from the defaults (the preset)."""
    per_step: ClassVar[bool] = False
    """Communicates every inner step (DDP and a comm hook), no outer loop."""
    peer: ClassVar[bool] = False
    """Another library's implementation run by our trainer for comparison (optional extra)."""
    baseline: ClassVar[bool] = False
    """The data-parallel reference other rows are compared with in reports."""
    sends_selection: ClassVar[bool] = False
    """Sends a sparse selection all-gathered (the simulator's collective), not a dense vector."""

    def config(self, workers: int | None = None, **overrides: Any) -> SyncConfig:
        """The SyncConfig of this method with ``overrides`` applied and validated; ``workers``
        (when known) sets what depends on the worker count."""
        base = dict(self.settings)
        if "fragments" in overrides and "blocks_per_fragment" not in overrides:
            base["blocks_per_fragment"] = 0  # an explicit count replaces the preset's blocks
        elif overrides.get("blocks_per_fragment", 0) > 0 and overrides.get("fragments", 1) > 1:
            raise ConfigError("give fragments (a count) or blocks_per_fragment, not both")
        base.update(self.by_workers(workers, overrides))
        base.update(overrides)
        if "alpha" not in overrides and not alpha_mixes(
            base.get("overlap", 0), base.get("merge", "alpha"), base.get("co2_merge", "continue")
        ):  # a preset's alpha is for the overlap it ships with: none where nothing mixes
            base.pop("alpha", None)
        return SyncConfig(**base)

    def by_workers(self, workers: int | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Settings that follow the worker count (none unless the method says so)."""
        return {}

    def check(self, sync_cfg: SyncConfig, cfg: TrainConfig, resume: str | None) -> None:
        """Refuse settings this method cannot run, before any worker starts."""

    def check_sites(self, cfg: TrainConfig) -> None:
        """Refuse a worker of several ranks (FSDP2 or DDP inside) when the method cannot run in
        one; outer-loop methods can."""

    def check_elastic(self, membership: MembershipConfig, rejoin: bool) -> None:
        """Refuse ``elastic=true`` settings the method cannot run; ``rejoin``: a site joins."""
        if self.per_step:
            raise ConfigError(
                f"elastic=true needs an outer-loop strategy: {self.name} all-reduces every "
                f"inner step and stays stop-the-world (use {_or(elastic_names())})"
            )

    def check_schedule(self, model: Any, sync_cfg: SyncConfig) -> None:
        """Build the method's fragment schedule on ``model`` (meta tensors will do): the
        engine's constructor checks the config and the fragments and sends nothing."""
        if self.per_step:
            return
        import torch

        from ..engine import LowComm

        LowComm(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_cfg)

    @property
    def joinable(self) -> bool:
        """Whether a site can join a running elastic run of this method (our own engine)."""
        return not (self.per_step or self.peer)

    def hook(self, cfg: TrainConfig) -> str:
        """A per-step method's DDP comm hook: ``loco``, or the trainer's ``ddp_hook``."""
        return cfg.ddp_hook

    def engine(
        self,
        model: Any,
        optimizer: Any,
        sync_cfg: SyncConfig,
        *,
        timeout_s: float,
        elastic: Any,
        peer_lighthouse: str,
    ) -> Any:
        """The outer loop of another library this method runs instead of lowcomm's engine (a
        peer's: see ``peer``), or None: lowcomm's own. ``elastic``: a site's membership
        settings; ``peer_lighthouse``: the address :meth:`own_lighthouse` serves at."""
        return None

    def own_lighthouse(self, options: dict[str, int]) -> Any:
        """A lighthouse of the method's own for an elastic run (another library's membership:
        its ``address()`` is handed to each site, its ``shutdown()`` ends it), or None."""
        return None

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        # pickled by name (workers are spawned with their run's spec): one instance per method;
        # with its module, so a plugin's (not installed: a source tree) is found in a worker too
        return (_unpickled, (self.name, type(self).__module__))


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: the method's one entry in :data:`REGISTRY` under ``cls.name``."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"strategy name {cls.name!r} is empty or taken")
    REGISTRY[cls.name] = cls()
    return cls


def get(name: str | Strategy) -> Strategy:
    """The strategy called ``name`` (a Strategy is returned as is; a plugin's looked for when
    the core has none of that name); ConfigError naming the choices for an unknown name."""
    if isinstance(name, Strategy):
        return name
    found = find(name)
    if found is None:
        raise ConfigError(f"unknown strategy '{name}': choose one of {', '.join(REGISTRY)}")
    return found


def find(name: str) -> Strategy | None:
    """The strategy called ``name``, or None (a recorded run's name read back, say); the
    plugins are loaded when the core has no method of that name."""
    if name not in REGISTRY:
        plugins.load()
    return REGISTRY.get(name)


def _unpickled(name: str, module: str) -> Strategy:
    """A strategy as a pickle names it: by name, its module imported if nothing holds it yet."""
    if find(name) is None:
        importlib.import_module(module)
    return get(name)


def names(*, peers: bool = True, per_step: bool = True) -> tuple[str, ...]:
    """The registered names, in order (the plugins' too); without peers or per-step methods
    if asked."""
    if peers:
        plugins.load()
    return tuple(
        n for n, s in REGISTRY.items() if (peers or not s.peer) and (per_step or not s.per_step)
    )


def _or(items: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return " or ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else "".join(items)


def elastic_names() -> tuple[str, ...]:
    """Our own outer-loop methods: the ones every elastic feature runs."""
    return tuple(n for n, s in REGISTRY.items() if s.joinable)
