"""``lowcomm train``: one run of one strategy, or ``--resume DIR`` to continue one."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError, build_configs, help_text
from .common import (
    Help,
    UsageError,
    add_config_port_overrides,
    add_model_and_steps,
    check_data,
    check_model,
    check_out_dir,
    config_values,
    existing_run,
    remove,
)


def _print_summary(summary: dict[str, Any] | None, out: Path) -> None:
    if summary is None:  # not rank 0 under torchrun
        return
    from ..train.summary import RunSummary, results_table

    print(results_table([RunSummary.from_dict(summary)]))
    print(f"summary: {out / 'summary.json'}")


def cmd_train(args: argparse.Namespace) -> int:
    """`lowcomm train`: one run of one strategy (or `--resume DIR` to continue one)."""
    from .. import strategies
    from ..train.launch import launch
    from ..train.spec import RunSpec

    if args.resume:
        return _resume(args)
    if args.strategy is None:
        raise UsageError("lowcomm train: --strategy is required (or --resume DIR)")
    strategy = strategies.get(args.strategy)
    args.workers = 2 if args.workers_given is None else args.workers_given
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    configs = build_configs(config_values(args), sync=strategy.config(args.workers))
    check_model(configs.train.model)
    check_data(configs.train.data)
    site = configs.membership.site
    if site >= 0 and args.workers_given is not None:
        raise ConfigError("site= runs one site here: drop --workers (sites=S is the run's count)")
    if site >= 0 and not args.overwrite:
        old = _site_folder(args.out)
    else:
        old = existing_run(args.out, args.overwrite)
    out = check_out_dir(args.out)
    # the old run goes only once the new one's settings, model and data have passed their checks
    spec = RunSpec.of(strategy, configs, out)
    summary = launch(spec, args.workers, args.port, on_checked=lambda: remove(old))
    _print_summary(summary, out)
    return 0


def _site_folder(path: str) -> list[Path]:
    """A site launched on its own (site=) into a folder it wrote before: a site coming back
    after it died keeps its files (it heals from the live sites and appends to its logs); a
    folder holding a finished run is refused, as any run's."""
    out = Path(path)
    if (out / "summary.json").exists():
        raise ConfigError(
            f"--out {out} holds a finished run (summary.json): give another --out, or "
            f"--overwrite to replace it"
        )
    if (out / "metrics.jsonl").exists() and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"lowcomm: --out {out} holds this site's unfinished run: the site comes back "
            f"into the run if it is going (it heals from the live sites; it waits up to "
            f"timeout_s for one) and appends to its files",
            flush=True,
        )
    return []


# settings a resumed run may change: how it is run and observed, and how long it goes on
RESUME_MAY_CHANGE = frozenset(
    {
        "steps",
        "checkpoint_every",
        "eval_every",
        "eval_batches",
        "log_every",
        "progress",
        "log",
        "timeout_s",
        "threads",
        "device",
        # faults on purpose and membership are how a run is exercised, not what it computes
        "faults",
        "replay",
        "elastic",
        "min_workers",
        "lighthouse",
        "heartbeat_timeout_s",
        "run_id",  # a resumed run keeps its id, or takes a new one (a new key, with a secret)
    }
)


def _resume(args: argparse.Namespace) -> int:
    """`lowcomm train --resume DIR`: continue the newest complete checkpoint of DIR."""
    from ..config import SAVED_BEFORE, SyncConfig, config_fields
    from ..train.launch import find_resume, launch
    from ..train.spec import RunSpec, saved_values

    last, meta = find_resume(args.resume)
    run = meta["run"]
    if args.strategy is not None and args.strategy != run["strategy"]:
        raise ConfigError(
            f"--resume {args.resume}: the run was trained with --strategy "
            f"{run['strategy']}, not {args.strategy}; drop --strategy to continue "
            f"it, or start a new run with another --out"
        )
    given = config_values(args)
    known = config_fields()  # the plugins' keys too, where the saved run has any
    saved = {**SAVED_BEFORE, **saved_values(run)}
    saved = {k: v for k, v in saved.items() if k in known}
    configs = build_configs({**saved, **given}, sync=SyncConfig())
    now = configs.flat()
    changed = sorted(k for k in given if k in saved and now[k] != saved[k])
    conflicts = [k for k in changed if k not in RESUME_MAY_CHANGE]
    if conflicts:
        listed = ", ".join(f"{k} (saved {saved[k]!r}, given {now[k]!r})" for k in conflicts)
        raise ConfigError(
            f"--resume {args.resume}: {listed} differ from the saved run; a resumed "
            f"run keeps its settings: start a new run with another --out to change "
            f"them"
        )
    if changed:
        print(
            f"warning: resuming with changed settings {changed}: the run will not match an "
            f"uninterrupted one",
            file=sys.stderr,
        )
    # meta counts ranks; a worker may hold several (ranks_per_worker)
    ranks = configs.train.ranks_per_worker
    saved_workers = meta.get("sites") or meta["world_size"] // ranks
    workers = args.workers_given if args.workers_given is not None else saved_workers
    if ranks > 1 and workers != saved_workers:
        raise ConfigError(
            f"--resume {args.resume}: a run with ranks_per_worker={ranks} "
            f"resumes on its {saved_workers} workers, not {workers}: drop --workers"
        )
    print(
        f"resuming {run['strategy']} from {last} (step {meta['step']}) on {workers} workers",
        flush=True,
    )
    out = Path(args.resume)
    _print_summary(
        launch(
            RunSpec.of(run["strategy"], configs, out, run.get("name"), last),
            workers,
            args.port,
        ),
        out,
    )
    return 0


def _add_train(sub: Any) -> None:
    t = sub.add_parser(
        "train",
        help="train one strategy",
        formatter_class=Help,
        usage="lowcomm train --strategy NAME [options] [key=value ...]\n"
        "       lowcomm train --resume DIR [options] [key=value ...]",
        epilog=lambda: (
            "config keys (key=value or in --config FILE.toml), with their defaults:\n" + help_text()
        ),
    )
    need = t.add_argument_group("required (unless --resume DIR)")
    need.add_argument(
        "--strategy",
        default=None,
        metavar="NAME",
        help="ddp, loco, diloco, streaming, sparseloco or co2",
    )
    t.add_argument(
        "--workers",
        type=int,
        default=None,
        dest="workers_given",
        metavar="M",
        help="local worker processes (default: 2, or the saved run's with --resume; "
        "ignored under torchrun)",
    )
    t.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="continue the run saved in DIR from its newest complete checkpoint "
        "(default: start a new run)",
    )
    add_model_and_steps(t)
    t.add_argument(
        "--out",
        default="runs/train",
        metavar="DIR",
        help="output folder; refused if it holds a run, unless --overwrite",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (its checkpoints and model included)",
    )
    t.add_argument(
        "--faults",
        default=None,
        metavar="SPEC",
        help="faults on purpose, KIND:SITE@STEP comma-separated (kill:2@35, hang:1@50, "
        "pause:1@40x8); same as faults=SPEC",
    )
    t.add_argument(
        "--replay",
        default=None,
        metavar="FILE",
        help="with elastic=true: re-enact the membership.jsonl of a run (each site leaves at "
        "the sync it left then, no real fault); same as replay=FILE",
    )
    add_config_port_overrides(t)
    t.set_defaults(func=cmd_train)
