"""`lowcomm train | compare | simulate | bench`: the command-line contract of docs/design.md.

User errors (unknown strategy or key, bad values, missing files, unwritable output, a port in
use) print one line naming the problem and the fix, and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from .config import ConfigError, build_configs, help_text, load_toml, parse_overrides


_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _check_out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".lowcomm-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to output folder {out}: {e.strerror}; choose a writable --out") from None
    return out


def _check_data(spec: str) -> None:
    if spec in ("stdlib", "") or spec.startswith("hf:"):
        return
    path = spec.rsplit(":", 1)[0] if spec.rsplit(":", 1)[-1] in ("uint8", "uint16", "uint32") else spec
    if not Path(path).exists():
        raise ConfigError(f"data path {path} does not exist: give a text file, a folder, a .bin "
                          f"token file, hf:NAME, or data=stdlib")


def _check_model(name: str) -> None:
    from .train.model import PRESETS

    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}")


def _values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    values.update(parse_overrides(args.overrides or []))
    for key in ("model", "steps"):
        v = getattr(args, key, None)
        if v is not None:
            values[key] = v
    return values


def cmd_train(args: argparse.Namespace) -> int:
    from .presets import STRATEGIES, preset_config
    from .train.launch import launch

    if args.resume:
        return _resume(args)
    if args.strategy is None:
        raise UsageError("lowcomm train: --strategy is required (or --resume DIR)")
    if args.strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy '{args.strategy}': choose one of {', '.join(STRATEGIES)}")
    args.workers = 2 if args.workers_given is None else args.workers_given
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    values = _values(args)
    sync_cfg, train_cfg = build_configs(values, sync=preset_config(args.strategy))
    _check_model(train_cfg.model)
    _check_data(train_cfg.data)
    out = _check_out_dir(args.out)
    summary = launch(args.strategy, sync_cfg, train_cfg, out, args.workers, args.port)
    if summary is not None:
        from .bench.compare import results_table
        from .train.summary import RunSummary

        print(results_table([RunSummary.from_dict(summary)]))
        print(f"summary: {out / 'summary.json'}")
    return 0


def _resume(args: argparse.Namespace) -> int:
    """`lowcomm train --resume DIR`: continue the newest complete checkpoint of DIR."""
    from .config import SyncConfig, TrainConfig
    from .train.launch import find_resume, launch

    last, meta = find_resume(args.resume)
    run = meta["run"]
    saved = {**run["sync"], **run["train"]}
    values = {**saved, **_values(args)}
    changed = sorted(k for k in values if k in saved and values[k] != saved[k])
    if changed:
        print(f"warning: resuming with changed settings {changed}: the run will not match an "
              f"uninterrupted one", file=sys.stderr)
    sync_cfg, train_cfg = build_configs(values, sync=SyncConfig(), train=TrainConfig())
    workers = args.workers_given if args.workers_given is not None else meta["world_size"]
    print(f"resuming {run['strategy']} from {last} (step {meta['step']}) on {workers} workers", flush=True)
    summary = launch(run["strategy"], sync_cfg, train_cfg, Path(args.resume), workers, args.port,
                     name=run.get("name"), resume=str(last))
    if summary is not None:
        from .bench.compare import results_table
        from .train.summary import RunSummary

        print(results_table([RunSummary.from_dict(summary)]))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .bench.compare import parse_entries, results_table, run_compare

    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    bandwidths = None
    if args.bandwidth or args.bandwidths:
        from .bench.netshape import NetworkUnavailable, check_prerequisites, parse_rate

        bandwidths = [b.strip() for b in (args.bandwidths or args.bandwidth).split(",") if b.strip()]
        for b in bandwidths:
            try:
                parse_rate(b)
            except ValueError as e:
                raise ConfigError(f"--bandwidth {b}: {e}") from None
        try:
            check_prerequisites()
        except NetworkUnavailable as e:
            raise ConfigError(f"shaped networks unavailable: {e}") from None
    entries = parse_entries(args.strategies)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    values = _values(args)
    sync_cfg, train_cfg = build_configs(values)  # validate the common keys early
    _check_model(train_cfg.model)
    _check_data(train_cfg.data)
    out = _check_out_dir(args.out)
    results = run_compare(entries, values, args.workers, seeds or [0], out, args.port,
                          bandwidths=bandwidths, topology=args.topology)
    print()
    print(results_table(results))
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}; plots: {out}/loss_vs_*.png")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`lowcomm report DIR...`: one table and plots over runs from several compare folders."""
    from .bench.compare import network_table, results_table, write_report

    out = Path(args.out)
    results = write_report([Path(p) for p in args.dirs], out, args.target_loss)
    print(results_table(results))
    if args.target_loss is not None:
        print()
        print(network_table(results, args.target_loss))
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}; plots: {out}/loss_vs_*.png")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim.cli import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "codecs":
        from .bench.codecs import main as bench_codecs

        return bench_codecs(args.rest)
    if args.what == "overhead":
        from .bench.overhead import main as bench_overhead

        return bench_overhead(args.rest)
    raise ConfigError(f"unknown benchmark '{args.what}': choose codecs or overhead")


def build_parser() -> argparse.ArgumentParser:
    """The `lowcomm` argument parser (config keys are listed in `train --help`)."""
    p = _Parser(prog="lowcomm", description="Low-communication distributed training.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    t = sub.add_parser("train", help="train one strategy", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="config keys (key=value or in --config FILE.toml):\n" + help_text())
    t.add_argument("--strategy", default=None, help="ddp, loco, diloco, streaming, sparseloco or co2")
    t.add_argument("--workers", type=int, default=None, dest="workers_given",
                   help="local worker processes (default 2; ignored under torchrun)")
    t.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run saved in DIR from its newest complete checkpoint")
    t.add_argument("--model", default=None, help="model preset: tiny, small, base, 124m")
    t.add_argument("--steps", type=int, default=None, help="inner steps per worker")
    t.add_argument("--out", default="runs/train", help="output folder")
    t.add_argument("--config", default=None, help="TOML file of config keys")
    t.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("compare", help="compare strategies on the same model, data and seed",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="config keys apply to every entry:\n" + help_text())
    c.add_argument("--strategies", default="ddp,diloco",
                   help="comma list; an entry may carry overrides: sparseloco:density=1/32:sync_every=50")
    c.add_argument("--workers", type=int, default=4)
    c.add_argument("--model", default=None)
    c.add_argument("--steps", type=int, default=None)
    c.add_argument("--seeds", default="0", help="comma list of seeds, e.g. 0,1")
    c.add_argument("--bandwidth", default=None, help="shape the link to this rate (e.g. 50mbit)")
    c.add_argument("--bandwidths", default=None, help="sweep these rates")
    c.add_argument("--topology", default="shared", choices=["shared", "per-worker"])
    c.add_argument("--out", default="runs/compare")
    c.add_argument("--config", default=None)
    c.add_argument("--port", type=int, default=None)
    c.add_argument("overrides", nargs="*", metavar="key=value")
    c.set_defaults(func=cmd_compare)

    r = sub.add_parser("report", help="one table and plots over finished runs from several folders")
    r.add_argument("dirs", nargs="+", help="run folders or `compare --out` folders")
    r.add_argument("--out", default="runs/report", help="where results.md, results.json and plots go")
    r.add_argument("--target-loss", type=float, default=None,
                   help="add a per-link table: utilization, tokens/s vs unshaped, time to this validation loss")
    r.set_defaults(func=cmd_report)

    s = sub.add_parser("simulate", help="compute utilization vs bandwidth at scales we cannot run")
    try:
        from .sim.cli import add_arguments

        add_arguments(s)
    except ImportError:
        pass
    s.set_defaults(func=cmd_simulate)

    b = sub.add_parser("bench", help="microbenchmarks: codecs, overhead")
    b.add_argument("what", help="codecs or overhead")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (e.g. --json)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lowcomm` command."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # key=value overrides may sit anywhere among the options (argparse cannot interleave them)
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    rest = [a for a in argv if not _OVERRIDE.match(a)]
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
    except (UsageError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a worker died or the run failed: one line, non-zero status
        from .train.launch import LaunchError

        if isinstance(e, LaunchError):
            print(f"error: {e}", file=sys.stderr)
            return e.exitcode
        raise


if __name__ == "__main__":
    sys.exit(main())
