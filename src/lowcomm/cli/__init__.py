"""`lowcomm train | join | lighthouse`: the command-line contract of docs/design.md, and the
commands other packages add (the lab's ``compare``, ``report``, ``simulate``, ``bench``).

User errors (unknown strategy or key, bad values, missing files, unwritable output, a port in
use) print one line naming the problem and the fix, and exit with status 2, never a traceback.

This package holds the parser and the entry point (:func:`main`, the ``lowcomm`` console
script; ``python -m lowcomm.cli`` runs it too); each core subcommand lives in its own module
(``train``, ``join``, ``lighthouse``), and ``common`` holds what every command shares. A
command of a plugin (:mod:`lowcomm.plugins`) is added with :func:`register_command`; the
plugins are loaded only for a command the core does not have, or for the help.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import Any

from ..errors import LowCommError
from .common import (  # noqa: F401  (the one-module CLI's names stay importable from here)
    Help,
    Parser,
    UsageError,
    check_data,
    check_model,
    check_out_dir,
    command_line,
    config_values,
    existing_run,
    port,
    remove,
)
from .join import _add_join, cmd_join
from .lighthouse import _add_lighthouse, cmd_lighthouse
from .train import (  # noqa: F401
    RESUME_MAY_CHANGE,
    _add_train,
    _print_summary,
    _resume,
    cmd_train,
)

__all__ = [
    "RESUME_MAY_CHANGE",
    "UsageError",
    "build_parser",
    "cmd_join",
    "cmd_lighthouse",
    "cmd_train",
    "main",
    "register_command",
]

_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

CORE = ("train", "join", "lighthouse")
# a plugin's commands: name -> (adds its parser to the subparsers, parses its own key=value)
_COMMANDS: dict[str, tuple[Callable[[Any], None], bool]] = {}


def register_command(name: str, add: Callable[[Any], None], own_args: bool = False) -> None:
    """A command of ``lowcomm`` from a plugin: ``add(subparsers)`` adds its parser (which sets
    ``func``); ``own_args``: it reads its ``key=value`` arguments itself (a benchmark passes
    them on to its runs)."""
    if name in CORE or _COMMANDS.get(name, (add, own_args)) != (add, own_args):
        raise ValueError(f"command {name!r} is taken")
    _COMMANDS[name] = (add, own_args)


def build_parser(plugins_too: bool = True) -> argparse.ArgumentParser:
    """The `lowcomm` argument parser (config keys are listed in `train --help`); with
    ``plugins_too``, the plugins' commands as well (loading the plugins)."""
    from .. import __version__, plugins

    p = Parser(prog="lowcomm", description="Low-communication distributed training.")
    p.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    _add_train(sub)
    _add_join(sub)
    _add_lighthouse(sub)
    if plugins_too:
        plugins.load()
        for add, _ in _COMMANDS.values():
            add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lowcomm` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # a command of the core's own needs no plugin (its help lists their keys: it loads them)
    parser = build_parser(plugins_too=not argv or argv[0] not in CORE)
    # key=value overrides may sit anywhere among the options (argparse cannot interleave them)
    # (a command that reads its own, a benchmark's, passes settings on to its runs)
    own = bool(argv) and _COMMANDS.get(argv[0], (None, False))[1]
    overrides = [] if own else [a for a in argv if _OVERRIDE.match(a)]
    rest = argv if own else [a for a in argv if not _OVERRIDE.match(a)]
    args: argparse.Namespace | None = None
    try:
        args = parser.parse_args(rest)
        if hasattr(args, "overrides"):
            args.overrides = (args.overrides or []) + overrides
        elif overrides:
            raise UsageError(f"lowcomm {args.command}: unexpected key=value arguments {overrides}")
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except (LowCommError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the workers started: nothing to resume
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a worker died or the run failed: one line, non-zero status
        from ..train.launch import Interrupted, LaunchError, peer_lost_message

        if isinstance(e, Interrupted):
            print(str(e), file=sys.stderr)
            return e.exitcode
        if isinstance(e, LaunchError):
            print(f"error: {e}", file=sys.stderr)
            return e.exitcode
        lost = peer_lost_message(e, _run_dir(args))
        if lost is not None:
            print(f"error: {lost}", file=sys.stderr)
            return 1
        raise


def _run_dir(args: argparse.Namespace | None) -> str | None:
    """The run folder a train command writes to (its --resume folder when resuming)."""
    if args is None or getattr(args, "command", None) != "train":
        return None
    return getattr(args, "resume", None) or getattr(args, "out", None)
