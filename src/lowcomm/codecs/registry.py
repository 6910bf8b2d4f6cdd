"""The codec registry: the one list of codecs, declared by ``@register(...)`` on each codec class.

A declaration names the codec as configs do (``codec=fp4``), its wire id (byte 3 of every
payload's header, see ``_format``), the :func:`make_codec` options it reads and the properties
other code asks about (dense, element-wise, sparse). The config's choices, ``make_codec`` and
``_format``'s id table all derive from it, so adding a codec is adding its file.

The config must import without torch, and the codec modules import torch, so the declarations
are read twice from the same text: :func:`specs` parses the ``@register`` calls out of this
package's files without importing them (hence their arguments must be literals, or names of
literal constants of the same module), and the decorator, run when a codec's module is imported,
hands :func:`make_codec` the class. This module imports neither torch nor any codec at import.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .. import plugins

if TYPE_CHECKING:
    from .base import Codec

_T = TypeVar("_T", bound=type)
_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """What one ``@register(name, ...)`` declares (the keywords are these fields)."""

    name: str
    #: header byte 3 of its payloads; None for an alias, whose payloads are its target's
    wire_id: int | None = None
    #: the make_codec options it reads (a config passes block_size=codec_block, density,
    #: value_bits); the others a caller passes are ignored
    options: tuple[str, ...] = ()
    #: constructor arguments fixed by this name (several names may share one class)
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the payload is the values in ``codec.dtype``: reduce=allreduce can sum them as they are
    dense: bool = False
    #: any 1-D slice encodes on its own: reduce=two-phase may cut a buffer into shards
    elementwise: bool = True
    #: the payload carries chosen entries: aggregation=selected-mean applies
    sparse: bool = False
    #: False for a building block that no config names (the top-k values' lookup codec)
    config: bool = True
    #: another name this one builds, options and payloads included (``loco`` is ``int4``)
    alias_of: str | None = None
    #: the module of this package that declares it (filled in by :func:`specs`)
    module: str = ""


# name -> class, filled by @register as the codec modules are imported
_CLASSES: dict[str, type] = {}
# codecs declared outside this package (a plugin's: lowcomm.plugins), as their modules import
_EXTERNAL: dict[str, CodecSpec] = {}


def register(name: str, **declared: Any) -> Callable[[_T], _T]:
    """Class decorator: the class is the codec ``name`` (keywords: :class:`CodecSpec`'s fields).

    It also sets the class's ``name`` and ``elementwise`` (the runtime asks the instance); a class
    with several names sets ``self.name`` per instance.
    """
    spec = CodecSpec(name, **declared)  # a misspelt keyword fails here, at import

    def decorate(cls: _T) -> _T:
        if spec.alias_of is None:
            cls.name = name
            cls.elementwise = spec.elementwise
        _CLASSES[name] = cls
        if not cls.__module__.startswith(f"{__package__}."):  # a plugin's: its spec with it
            taken = {s.wire_id: s.name for s in _package_specs().values()}
            if name in _package_specs() or spec.wire_id in taken:
                raise ValueError(f"codec {name!r} (wire id {spec.wire_id}) is taken")
            _EXTERNAL[name] = dataclasses.replace(spec, module=cls.__module__)
        return cls

    return decorate


def specs() -> dict[str, CodecSpec]:
    """Every declared name -> its spec: this package's (read from its files without importing
    them; ordered by wire id, aliases last: the order configs list the choices in), then the
    plugins' registered so far."""
    return {**_package_specs(), **_EXTERNAL}


@cache
def _package_specs() -> dict[str, CodecSpec]:
    """This package's declared names -> their specs, read from its files."""
    found: dict[str, CodecSpec] = {}
    for path in sorted(_DIR.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "@register(" not in text:  # most files: skip the parse
            continue
        for spec in _declared(path, ast.parse(text, filename=str(path))):
            if spec.name in found:
                raise ValueError(f"codec {spec.name!r} registered twice ({path.name})")
            found[spec.name] = spec
    ids: dict[int, str] = {}
    for spec in found.values():
        if spec.alias_of is not None:
            target = found.get(spec.alias_of)
            if target is None or target.alias_of is not None:
                raise ValueError(f"codec {spec.name!r} is an alias of no codec {spec.alias_of!r}")
            # an alias is its target under another name: same options, properties and payloads
            found[spec.name] = dataclasses.replace(
                target, name=spec.name, wire_id=None, alias_of=target.name, config=spec.config
            )
        elif spec.wire_id is None or not 0 < spec.wire_id < 256 or spec.wire_id in ids:
            raise ValueError(
                f"codec {spec.name!r} needs a wire id in 1..255 of its own, got {spec.wire_id}"
                + (f" (that of {ids[spec.wire_id]!r})" if spec.wire_id in ids else "")
            )
        else:
            ids[spec.wire_id] = spec.name
    order = sorted(found.values(), key=lambda s: (s.alias_of is not None, s.wire_id or 0))
    return {s.name: s for s in order}


def _declared(path: Path, tree: ast.Module) -> list[CodecSpec]:
    """The specs that the ``@register(...)`` decorators of a module's top-level classes declare."""
    consts = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
    }

    def literal(node: ast.expr) -> Any:
        if isinstance(node, ast.Name) and node.id in consts:
            node = consts[node.id]
        try:
            return ast.literal_eval(node)
        except ValueError:
            raise ValueError(
                f"{path.name}:{node.lineno}: @register arguments must be literals (the config "
                f"reads them without importing the module): {ast.unparse(node)}"
            ) from None

    out = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for dec in cls.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "register":
                kwargs = {k.arg: literal(k.value) for k in dec.keywords if k.arg}
                if "options" in kwargs:
                    kwargs["options"] = tuple(kwargs["options"])
                out.append(CodecSpec(*map(literal, dec.args), **kwargs, module=path.stem))
    return out


def codec_names(core: bool = False, **where: bool) -> tuple[str, ...]:
    """The names a config may choose (``codec=NAME``) whose specs have every given property,
    e.g. ``codec_names(dense=True)``; ``core``: this package's only (not a plugin's, whether
    or not one was loaded yet)."""
    table = _package_specs() if core else specs()
    return tuple(
        s.name
        for s in table.values()
        if s.config and all(getattr(s, k) == v for k, v in where.items())
    )


def codec_class(name: str) -> type:
    """The class registered as ``name`` (imports its module, and with it torch)."""
    if name not in _CLASSES:
        importlib.import_module(f"{__package__}.{specs()[name].module}")
    return _CLASSES[name]


def make_codec(name: str, **opts: Any) -> Codec:
    """Build the codec called ``name`` (one of CODEC_NAMES) with its options.

    A config may pass every codec knob to every codec: options of *other* codecs and options
    given as None are ignored, while an option no codec reads (a typo) raises ValueError.
    ``kernels`` ("auto" or "torch", :mod:`.kernels`) is every codec's.
    """
    table = specs()
    if name not in table and plugins.load():  # a plugin's codec, perhaps
        table = specs()
    spec = table.get(name)
    if spec is None or not spec.config:
        raise ValueError(f"unknown codec {name!r}; valid names: {', '.join(codec_names())}")
    mode = opts.pop("kernels", None)  # every codec's: which kernels its plans run
    known = {o for s in table.values() if s.config for o in s.options}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown codec option(s) {unknown}; valid options: {sorted(known)}")
    if spec.alias_of is not None:
        spec = table[spec.alias_of]
    kwargs = {k: v for k, v in opts.items() if v is not None and k in spec.options}
    codec = codec_class(spec.name)(**spec.args, **kwargs)
    if mode is not None:
        from .kernels import check_mode

        codec.kernels = check_mode(mode)
    return codec
