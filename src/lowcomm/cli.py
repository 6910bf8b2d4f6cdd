"""`lowcomm train | compare | simulate | bench`: the command-line contract of docs/design.md.

User errors (unknown strategy or key, bad values, missing files, unwritable output, a port in
use) print one line naming the problem and the fix, and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .config import ConfigError, TrainConfig, build_configs, help_text, load_toml, parse_overrides
from .errors import LowCommError

_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class UsageError(LowCommError):
    """Bad command-line input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        raise UsageError(f"{self.prog}: {message} (see --help)")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default unless its help already names it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text


def _port(text: str) -> int:
    """argparse type of --port: a TCP port number."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a TCP port (1-65535); omit --port to pick a free one"
        )
    return port


def _check_out_dir(path: str | Path) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # a probe of this process's own: the workers of one run check the same folder at once
        with tempfile.NamedTemporaryFile(dir=out, prefix=".lowcomm-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"cannot write to output folder {out}: {e.strerror}; choose a writable --out"
        ) from None
    return out


# a folder holding any of these holds a run (a new run there needs --overwrite) ...
_RUN_MARKS = ("summary.json", "metrics.jsonl", "model.pt", "checkpoints")
# ... and --overwrite removes these too (what else a run writes in its folder)
_RUN_OUTPUTS = _RUN_MARKS + ("corpus.json", "workers.json", "workers.json.tmp", "tensorboard", "hf")


def _existing_run(path: str, overwrite: bool) -> list[Path]:
    """What a run already wrote in --out: refused unless --overwrite (then it is to be removed)."""
    out = Path(path)
    marks = [n for n in _RUN_MARKS if (out / n).exists()]
    if marks and not overwrite:
        raise ConfigError(
            f"--out {out} holds a run already ({', '.join(marks)}): use --resume "
            f"{out} to continue it or --overwrite to replace it"
        )
    return [out / n for n in _RUN_OUTPUTS if (out / n).exists()] if marks else []


def _remove(paths: list[Path]) -> None:
    """Remove the old run's files and folders (only what a run writes: other files stay)."""
    for target in paths:
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def _check_model(name: str) -> None:
    from .train.model import PRESETS

    if name not in PRESETS and not name.startswith("hf:"):  # hf: names are checked by lowcomm.hf
        raise ConfigError(f"unknown model preset '{name}': choose one of {', '.join(PRESETS)}")


def _values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    values.update(parse_overrides(args.overrides or []))
    for key in ("model", "steps", "ranks_per_worker"):
        v = getattr(args, key, None)
        if v is not None:
            values[key] = v
    return values


def _print_summary(summary: dict[str, Any] | None, out: Path) -> None:
    if summary is None:  # not rank 0 under torchrun
        return
    from .bench.compare import results_table
    from .train.summary import RunSummary

    print(results_table([RunSummary.from_dict(summary)]))
    print(f"summary: {out / 'summary.json'}")


def cmd_train(args: argparse.Namespace) -> int:
    """`lowcomm train`: one run of one strategy (or `--resume DIR` to continue one)."""
    from .presets import STRATEGIES, preset_config
    from .train.launch import launch

    if args.resume:
        return _resume(args)
    if args.strategy is None:
        raise UsageError("lowcomm train: --strategy is required (or --resume DIR)")
    if args.strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy '{args.strategy}': choose one of {', '.join(STRATEGIES)}"
        )
    args.workers = 2 if args.workers_given is None else args.workers_given
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    sync_cfg, train_cfg = build_configs(
        _values(args), sync=preset_config(args.strategy, workers=args.workers)
    )
    _check_model(train_cfg.model)
    _check_data(train_cfg.data)
    old = _existing_run(args.out, args.overwrite)
    out = _check_out_dir(args.out)
    # the old run goes only once the new one's settings, model and data have passed their checks
    summary = launch(
        args.strategy,
        sync_cfg,
        train_cfg,
        out,
        args.workers,
        args.port,
        on_checked=lambda: _remove(old),
    )
    _print_summary(summary, out)
    return 0


def _check_data(spec: str) -> None:
    """A missing corpus path named now (the full data check runs in the launcher)."""
    if spec in ("stdlib", "") or spec.startswith("hf:"):
        return
    from .train.data import _split_dtype

    path, _ = _split_dtype(spec)
    if not path.exists():
        raise ConfigError(
            f"data path {path} does not exist: give a text file, a folder, a .bin "
            f"token file, hf:NAME, or data=stdlib"
        )


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
    }
)


def _resume(args: argparse.Namespace) -> int:
    """`lowcomm train --resume DIR`: continue the newest complete checkpoint of DIR."""
    from .config import SAVED_BEFORE, SyncConfig, TrainConfig, config_fields
    from .train.launch import find_resume, launch

    last, meta = find_resume(args.resume)
    run = meta["run"]
    if args.strategy is not None and args.strategy != run["strategy"]:
        raise ConfigError(
            f"--resume {args.resume}: the run was trained with --strategy "
            f"{run['strategy']}, not {args.strategy}; drop --strategy to continue "
            f"it, or start a new run with another --out"
        )
    known = config_fields()
    saved = {**SAVED_BEFORE, **run["sync"], **run["train"]}
    saved = {k: v for k, v in saved.items() if k in known}
    given = _values(args)
    sync_cfg, train_cfg = build_configs({**saved, **given}, sync=SyncConfig(), train=TrainConfig())
    now = {**dataclasses.asdict(sync_cfg), **dataclasses.asdict(train_cfg)}
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
    saved_workers = meta["world_size"] // train_cfg.ranks_per_worker
    workers = args.workers_given if args.workers_given is not None else saved_workers
    if train_cfg.ranks_per_worker > 1 and workers != saved_workers:
        raise ConfigError(
            f"--resume {args.resume}: a run with ranks_per_worker={train_cfg.ranks_per_worker} "
            f"resumes on its {saved_workers} workers, not {workers}: drop --workers"
        )
    print(
        f"resuming {run['strategy']} from {last} (step {meta['step']}) on {workers} workers",
        flush=True,
    )
    out = Path(args.resume)
    _print_summary(
        launch(
            run["strategy"],
            sync_cfg,
            train_cfg,
            out,
            workers,
            args.port,
            name=run.get("name"),
            resume=str(last),
        ),
        out,
    )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .bench.compare import parse_entries, results_table, run_compare

    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    bandwidths = None
    if args.bandwidth or args.bandwidths:
        from .bench.netshape import NetworkUnavailable, check_prerequisites, parse_rate

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
    values = _values(args)
    sync_cfg, train_cfg = build_configs(values)  # validate the common keys early
    _check_model(train_cfg.model)
    _check_data(train_cfg.data)
    out = _check_out_dir(args.out)
    results = run_compare(
        entries,
        values,
        args.workers,
        seeds or [0],
        out,
        args.port,
        bandwidths=bandwidths,
        topology=args.topology,
        command=_command(),
    )
    print()
    print(results_table(results))
    print(f"\nresults: {out / 'results.md'}, {out / 'results.json'}; plots: {out}/loss_vs_*.png")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`lowcomm report DIR...`: one table and plots over runs from several compare folders."""
    from .bench.compare import network_table, results_table, write_report

    out = Path(args.out)
    results = write_report([Path(p) for p in args.dirs], out, args.target_loss, command=_command())
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
    if args.what == "sync":
        from .bench.sync import main as bench_sync

        return bench_sync(args.rest)
    raise ConfigError(f"unknown benchmark '{args.what}': choose codecs, overhead or sync")


def _command() -> str:
    """This process's command line, as a user would type it (for results.md and plots)."""
    return " ".join(["lowcomm", *sys.argv[1:]])


def build_parser() -> argparse.ArgumentParser:
    """The `lowcomm` argument parser (config keys are listed in `train --help`)."""
    from . import __version__

    p = _Parser(prog="lowcomm", description="Low-communication distributed training.")
    p.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    _add_train(sub)
    _add_compare(sub)
    r = sub.add_parser(
        "report",
        help="one table and plots over finished runs from several folders",
        formatter_class=_Help,
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
    s = sub.add_parser("simulate", help="compute utilization vs bandwidth at scales we cannot run")
    try:
        from .sim.cli import add_arguments

        add_arguments(s)
    except ImportError:
        pass
    s.set_defaults(func=cmd_simulate)
    b = sub.add_parser("bench", help="microbenchmarks: codecs, overhead, sync")
    b.add_argument("what", help="codecs, overhead or sync")
    b.add_argument(
        "rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (e.g. --json)"
    )
    b.set_defaults(func=cmd_bench)
    return p


_MODEL_HELP = (
    f"model preset: tiny, small, base, 124m, or a Hugging Face causal LM: hf:ARCH[:PRESET] "
    f"(llama, gpt2, qwen2, ...) or hf:PATH (default: {TrainConfig.model}, the model key)"
)
_STEPS_HELP = f"inner steps per worker (default: {TrainConfig.steps}, the steps key)"


def _add_train(sub: Any) -> None:
    t = sub.add_parser(
        "train",
        help="train one strategy",
        formatter_class=_Help,
        usage="lowcomm train --strategy NAME [options] [key=value ...]\n"
        "       lowcomm train --resume DIR [options] [key=value ...]",
        epilog="config keys (key=value or in --config FILE.toml), with their defaults:\n"
        + help_text(),
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
    _add_model_and_steps(t)
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
    _add_config_port_overrides(t)
    t.set_defaults(func=cmd_train)


def _add_model_and_steps(p: argparse.ArgumentParser) -> None:
    """--model and --steps, shared by train and compare."""
    p.add_argument("--model", default=None, metavar="PRESET", help=_MODEL_HELP)
    p.add_argument("--steps", type=int, default=None, metavar="N", help=_STEPS_HELP)
    p.add_argument(
        "--ranks-per-worker",
        type=int,
        default=None,
        metavar="N",
        help="ranks training one worker's replica together (default 1; same as "
        "ranks_per_worker=N; FSDP2 inside, or inner_parallel=ddp): --workers M starts M x N "
        "processes",
    )


def _add_config_port_overrides(p: argparse.ArgumentParser) -> None:
    """--config, --port and the key=value overrides, shared by train and compare."""
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="TOML file of config keys (default: none)",
    )
    p.add_argument("--port", type=_port, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def _add_compare(sub: Any) -> None:
    c = sub.add_parser(
        "compare",
        help="compare strategies on the same model, data and seed",
        formatter_class=_Help,
        epilog="config keys apply to every entry:\n" + help_text(),
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
    _add_model_and_steps(c)
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
    _add_config_port_overrides(c)
    c.set_defaults(func=cmd_compare)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `lowcomm` command."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # key=value overrides may sit anywhere among the options (argparse cannot interleave them)
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    rest = [a for a in argv if not _OVERRIDE.match(a)]
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
        from .train.launch import Interrupted, LaunchError, peer_lost_message

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


if __name__ == "__main__":
    sys.exit(main())
