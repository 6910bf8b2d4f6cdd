"""``lowcomm simulate`` (the compute-utilization simulator) and ``lowcomm bench`` (the codec,
overhead and sync-cost microbenchmarks): thin handoffs to the modules that do the work."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from lowcomm.config import ConfigError


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..sim.cli import run

    return run(args)


BENCHES = (
    "codecs",
    "overhead",
    "sync",
    "elastic",
    "sites",
    "heal",
    "stragglers",
    "chaos",
    "attacks",
)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what not in BENCHES:
        raise ConfigError(f"unknown benchmark '{args.what}': choose {', '.join(BENCHES)}")
    module = importlib.import_module(f"..bench.{args.what}", __package__)
    return module.main(args.rest)


def _add_simulate(sub: Any) -> None:
    s = sub.add_parser("simulate", help="compute utilization vs bandwidth at scales we cannot run")
    try:
        from ..sim.cli import add_arguments

        add_arguments(s)
    except ImportError:
        pass
    s.set_defaults(func=cmd_simulate)


def _add_bench(sub: Any) -> None:
    b = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHES)}")
    b.add_argument("what", help=", ".join(BENCHES))
    b.add_argument(
        "rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (e.g. --json)"
    )
    b.set_defaults(func=cmd_bench)
