"""``lowcomm simulate`` (the compute-utilization simulator) and ``lowcomm bench`` (the codec,
overhead and sync-cost microbenchmarks): thin handoffs to the modules that do the work."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import ConfigError


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..sim.cli import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "codecs":
        from ..bench.codecs import main as bench_codecs

        return bench_codecs(args.rest)
    if args.what == "overhead":
        from ..bench.overhead import main as bench_overhead

        return bench_overhead(args.rest)
    if args.what == "sync":
        from ..bench.sync import main as bench_sync

        return bench_sync(args.rest)
    if args.what == "elastic":
        from ..bench.elastic import main as bench_elastic

        return bench_elastic(args.rest)
    raise ConfigError(f"unknown benchmark '{args.what}': choose codecs, overhead, sync or elastic")


def _add_simulate(sub: Any) -> None:
    s = sub.add_parser("simulate", help="compute utilization vs bandwidth at scales we cannot run")
    try:
        from ..sim.cli import add_arguments

        add_arguments(s)
    except ImportError:
        pass
    s.set_defaults(func=cmd_simulate)


def _add_bench(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks: codecs, overhead, sync, elastic")
    b.add_argument("what", help="codecs, overhead, sync or elastic")
    b.add_argument(
        "rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (e.g. --json)"
    )
    b.set_defaults(func=cmd_bench)
