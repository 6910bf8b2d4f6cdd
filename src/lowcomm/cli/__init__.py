"""`lowcomm train | join | lighthouse | compare | report | simulate | bench`: the command-line
contract of docs/design.md.

User errors (unknown strategy or key, bad values, missing files, unwritable output, a port in
use) print one line naming the problem and the fix, and exit with status 2, never a traceback.

This package holds the parser and the entry point (:func:`main`, the ``lowcomm`` console
script; ``python -m lowcomm.cli`` runs it too); each subcommand lives in its own module
(``train``, ``join``, ``compare`` with ``report``, ``tools`` for simulate and bench), and
``common`` holds what they share.
"""

from __future__ import annotations

import argparse
import re
import sys

from ..errors import LowCommError
from .common import (  # noqa: F401  (the one-module CLI's names stay importable from here)
    UsageError,
    _check_data,
    _check_model,
    _check_out_dir,
    _command,
    _existing_run,
    _Help,
    _Parser,
    _port,
    _remove,
    _values,
)
from .compare import _add_compare, _add_report, cmd_compare, cmd_report
from .join import _add_join, cmd_join
from .lighthouse import _add_lighthouse, cmd_lighthouse
from .tools import _add_bench, _add_simulate, cmd_bench, cmd_simulate
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
    "cmd_bench",
    "cmd_compare",
    "cmd_join",
    "cmd_lighthouse",
    "cmd_report",
    "cmd_simulate",
    "cmd_train",
    "main",
]

_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def build_parser() -> argparse.ArgumentParser:
    """The `lowcomm` argument parser (config keys are listed in `train --help`)."""
    from .. import __version__

    p = _Parser(prog="lowcomm", description="Low-communication distributed training.")
    p.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    _add_train(sub)
    _add_join(sub)
    _add_lighthouse(sub)
    _add_compare(sub)
    _add_report(sub)
    _add_simulate(sub)
    _add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lowcomm` command."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # key=value overrides may sit anywhere among the options (argparse cannot interleave them)
    # (a benchmark parses its own arguments, settings it passes on to its runs among them)
    bench = bool(argv) and argv[0] == "bench"
    overrides = [] if bench else [a for a in argv if _OVERRIDE.match(a)]
    rest = argv if bench else [a for a in argv if not _OVERRIDE.match(a)]
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
