"""Reading config values: ``key=value`` items and TOML files into SyncConfig and TrainConfig,
the one namespace of keys, the ``--help`` text, and sorting keyword arguments into SyncConfig
knobs and the rest."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .checks import validate_train
from .schema import SyncConfig, TrainConfig

SAVED_BEFORE: dict[str, Any] = {"co2_keep": 1.0}
"""Knobs added after runs were saved, each with the value that reproduces such a run: a
checkpoint that lacks one resumes with the behaviour it was trained with, not today's default."""


def config_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every config key -> (owning dataclass, field): the one namespace of `key=value`."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in (SyncConfig, TrainConfig):
        for f in fields(cls):
            out[f.name] = (cls, f)
    return out


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


def build_configs(
    values: dict[str, Any], sync: SyncConfig | None = None, train: TrainConfig | None = None
) -> tuple[SyncConfig, TrainConfig]:
    """Apply `values` (from TOML and key=value) over the given configs; unknown keys are errors."""
    known = config_fields()
    sync_kw: dict[str, Any] = {}
    train_kw: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            close = [k for k in known if k.startswith(key[:4])] if len(key) >= 4 else []
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown config key '{key}'{hint}: see `lowcomm train --help` for the keys"
            )
        cls, f = known[key]
        (sync_kw if cls is SyncConfig else train_kw)[key] = _coerce(key, f, raw)
    if "fragments" in sync_kw and "blocks_per_fragment" not in sync_kw:
        sync_kw["blocks_per_fragment"] = (
            0  # an explicit count replaces a preset's blocks per fragment
        )
    s = dataclasses.replace(sync or SyncConfig(), **sync_kw)
    t = dataclasses.replace(train or TrainConfig(), **train_kw)
    s.validate()
    validate_train(t)
    return s, t


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
    """One line per config key, for `--help`."""
    lines = []
    for cls in (SyncConfig, TrainConfig):
        lines.append(f"{cls.__name__} keys:")
        for f in fields(cls):
            lines.append(f"  {f.name}={f.default!r}: {f.metadata.get('help', '')}")
    return "\n".join(lines)
