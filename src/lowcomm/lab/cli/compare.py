"""``lowcomm compare`` (strategies side by side on the same model, data and seed, optionally
over shaped links) and ``lowcomm report`` (one table and plots over finished runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lowcomm.cli.common import (
    Help,
    add_config_port_overrides,
    add_model_and_steps,
    check_data,
    check_model,
    check_out_dir,
    command_line,
    config_values,
)
from lowcomm.config import ConfigError, build_configs, help_text


def cmd_compare(args: argparse.Namespace) -> int:
    from ..bench.compare import parse_entries, results_table, run_compare

    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    bandwidths = None
    if args.bandwidth or args.bandwidths:
        from ..netshape import NetworkUnavailable, check_prerequisites, parse_rate

        rates = (args.bandwidths or args.bandwidth).split(",")
        bandwidths = [b.strip() for b in rates if b.strip()]
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
    values = config_values(args)
    train_cfg = build_configs(values).train  # validate the common keys early
    check_model(train_cfg.model)
    check_data(train_cfg.data)
    out = check_out_dir(args.out)
    results = run_compare(
        entries,
        values,
        args.workers,
        seeds or [0],
        out,
        args.port,
        bandwidths=bandwidths,
        topology=args.topology,
        command=command_line(),
    )
    print()
    print(results_table(results))
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}; plots: {out}/loss_vs_*.png")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`lowcomm report DIR...`: one table and plots over runs from several compare folders."""
    from ..bench.report import network_table, results_table, write_report

    out = Path(args.out)
    dirs = [Path(p) for p in args.dirs]
    results = write_report(dirs, out, args.target_loss, command=command_line())
    print(results_table(results))
    if args.target_loss is not None:
        print()
        print(network_table(results, args.target_loss))
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}; plots: {out}/loss_vs_*.png")
    return 0


def _add_compare(sub: Any) -> None:
    c = sub.add_parser(
        "compare",
        help="compare strategies on the same model, data and seed",
        formatter_class=Help,
        epilog=lambda: "config keys apply to every entry:\n" + help_text(),
    )
    c.add_argument(
        "--strategies",
        default="ddp,diloco",
        metavar="LIST",
        help="comma list; an entry may carry overrides: sparseloco:density=1/32:sync_every=50",
    )
    c.add_argument(
        "--workers", type=int, default=2, metavar="M", help="local worker processes per run"
    )
    add_model_and_steps(c)
    c.add_argument("--seeds", default="0", help="comma list of seeds, e.g. 0,1")
    c.add_argument(
        "--bandwidth",
        default=None,
        metavar="RATE",
        help="shape the link to this rate, e.g. 50mbit (default: unshaped)",
    )
    c.add_argument(
        "--bandwidths",
        default=None,
        metavar="LIST",
        help="sweep these rates, e.g. 10mbit,100mbit,1gbit (default: no sweep)",
    )
    c.add_argument(
        "--topology",
        default="shared",
        choices=["shared", "per-worker", "per-node"],
        help="shaped links: one shared by all workers, or one per worker; per-node: the same, "
        "all ranks of a worker (ranks_per_worker) in its namespace on an unshaped local link",
    )
    c.add_argument(
        "--out",
        default="runs/compare",
        metavar="DIR",
        help="output folder: one subfolder per run, results.md/json and plots",
    )
    add_config_port_overrides(c)
    c.set_defaults(func=cmd_compare)


def _add_report(sub: Any) -> None:
    r = sub.add_parser(
        "report",
        help="one table and plots over finished runs from several folders",
        formatter_class=Help,
    )
    r.add_argument("dirs", nargs="+", help="run folders or `compare --out` folders")
    r.add_argument(
        "--out", default="runs/report", help="where results.md, results.json and plots go"
    )
    r.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="add a per-link table: utilization, tokens/s vs unshaped, time to this "
        "validation loss (default: no such table)",
    )
    r.set_defaults(func=cmd_report)
