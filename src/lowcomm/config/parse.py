"""Reading config values: ``key=value`` items and TOML files into the settings tree
(:class:`Configs`: the engine's SyncConfig, the trainer's TrainConfig, membership's
MembershipConfig, and the nodes extensions register), the one namespace of keys, the
``--help`` text, and sorting keyword arguments into SyncConfig knobs and the rest."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .. import plugins
from ..errors import ConfigError
from .membership import MembershipConfig
from .schema import SyncConfig, TrainConfig

SAVED_BEFORE: dict[str, Any] = {"co2_keep": 1.0}
"""Knobs added after runs were saved, each with the value that reproduces such a run: a
checkpoint that lacks one resumes with the behaviour it was trained with, not today's default."""


@dataclass(frozen=True)
class Configs:
    """A run's settings as one tree, each node owned by its part: the engine's (``sync``), the
    trainer's own (``train``), membership's (``membership``), and each extension's (the lab's)
    by the name it registered. Every key names one field of one node."""

    sync: SyncConfig
    train: TrainConfig
    membership: MembershipConfig
    extensions: dict[str, Any]

    def flat(self) -> dict[str, Any]:
        """Every node's fields as one dict of keys (as runs record their ``config``)."""
        out: dict[str, Any] = {}
        for node in (self.train, self.sync, self.membership, *self.extensions.values()):
            out.update(dataclasses.asdict(node))
        return out


_EXTENSIONS: dict[str, type] = {}


def register_node(name: str, cls: type) -> None:
    """A dataclass of settings an extension owns (its fields are config keys too, with their
    help texts); ``name`` names its node. Keys must not clash with any other node's."""
    taken = config_fields(load=False)
    clash = sorted(f.name for f in fields(cls) if f.name in taken and taken[f.name][0] is not cls)
    if clash or _EXTENSIONS.get(name, cls) is not cls:
        raise ValueError(f"config node {name!r} clashes with another over {clash or name}")
    _EXTENSIONS[name] = cls


def nodes(load: bool = True) -> dict[str, type]:
    """Every node of the tree by name: the core's, then the extensions' (with ``load``, the
    installed plugins' too: see :mod:`lowcomm.plugins`)."""
    if load:
        plugins.load()
    return {"sync": SyncConfig, "train": TrainConfig, "membership": MembershipConfig,
            **_EXTENSIONS}  # fmt: skip


def config_fields(load: bool = True) -> dict[str, tuple[type, dataclasses.Field]]:
    """Every config key -> (owning dataclass, field): the one namespace of `key=value`. The
    plugins' nodes are looked for only when a key is not the core's (``load``)."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in nodes(load=load).values():
        for f in fields(cls):
            out[f.name] = (cls, f)
    return out


def core_keys() -> set[str]:
    """The keys of the core's own nodes (what every run's settings hold, with or without an
    extension)."""
    return {f.name for cls in (SyncConfig, TrainConfig, MembershipConfig) for f in fields(cls)}


def _owner(key: str) -> tuple[type, dataclasses.Field] | None:
    """The node and field of ``key``, loading the plugins if the core has none."""
    known = config_fields(load=False)
    if key not in known and plugins.load():
        known = config_fields(load=False)
    return known.get(key)


def _coerce(name: str, f: dataclasses.Field, raw: Any) -> Any:
    kind = type(f.default)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    if isinstance(raw, (int, float)) and kind is float and not isinstance(raw, bool):
        return float(raw)
    text = str(raw).strip()
    try:
        if kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            if "/" in text:  # density=1/64 reads naturally
                num, den = text.split("/", 1)
                return float(num) / float(den)
            return float(text)
        return text
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`key=value` strings -> dict, rejecting malformed items."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not key=value (e.g. sync_every=50)")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; flat keys, or tables whose keys are merged
    (e.g. [sync], [train])."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found: give an existing .toml file")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    return flat


def build_configs(values: dict[str, Any], sync: SyncConfig | None = None) -> Configs:
    """Apply `values` (from TOML and key=value) over the defaults of every node (``sync``: the
    engine's starting point, a strategy's preset); unknown keys are errors, each node checks
    its own settings."""
    given: dict[type, dict[str, Any]] = {}
    for key, raw in values.items():
        owner = _owner(key)
        if owner is None:
            known = config_fields(load=False)
            close = [k for k in known if k.startswith(key[:4])] if len(key) >= 4 else []
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown config key '{key}'{hint}: see `lowcomm train --help` for the keys"
            )
        cls, f = owner
        given.setdefault(cls, {})[key] = _coerce(key, f, raw)
    sync_kw = given.get(SyncConfig, {})
    if "fragments" in sync_kw and "blocks_per_fragment" not in sync_kw:
        sync_kw["blocks_per_fragment"] = 0  # an explicit count replaces a preset's blocks
    s = dataclasses.replace(sync or SyncConfig(), **sync_kw)
    s.validate()
    t = TrainConfig(**given.get(TrainConfig, {}))
    m = MembershipConfig(**given.get(MembershipConfig, {}))
    ext = {name: cls(**given[cls]) for name, cls in nodes(load=False).items()
           if cls in given and cls in _EXTENSIONS.values()}  # fmt: skip
    return Configs(s, t, m, ext)


def split_sync_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort keyword arguments into SyncConfig knobs and the rest (``(sync, other)``, each in the
    order given), e.g. a preset's ``sync_every=50, timeout_s=60``.

    ``fragments`` must be a count: explicit lists of module names go in ``fragment_modules``.
    """
    known = {f.name for f in fields(SyncConfig)}
    sync = {k: v for k, v in kwargs.items() if k in known}
    other = {k: v for k, v in kwargs.items() if k not in known}
    if "fragments" in sync and not isinstance(sync["fragments"], int):
        raise ConfigError(
            "fragments is a count of fragments; give explicit lists of module names "
            "as fragment_modules=[[...], ...]"
        )
    return sync, other


def help_text() -> str:
    """One line per config key, for `--help` (the plugins' keys too)."""
    lines = []
    for cls in nodes().values():
        lines.append(f"{cls.__name__} keys:")
        for f in fields(cls):
            lines.append(f"  {f.name}={f.default!r}: {f.metadata.get('help', '')}")
    return "\n".join(lines)
