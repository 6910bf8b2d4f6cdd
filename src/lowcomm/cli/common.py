"""What every ``lowcomm`` subcommand shares: the one-line usage error, the parser and help
classes, the ``--model/--steps`` and ``--config/--port/key=value`` options, reading config values,
and the checks of --out, --model and data= that run before anything starts."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig, load_toml, parse_overrides
from ..errors import LowCommError


class UsageError(LowCommError):
    """Bad command-line input: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, with errors as one line, and an epilog that may be a function: made
    only when the help is shown (the list of config keys loads the plugins' keys)."""

    def error(self, message: str) -> None:  # one line, exit 2, like every other user error
        raise UsageError(f"{self.prog}: {message} (see --help)")

    def format_help(self) -> str:
        """The help, its epilog made now if it is a function."""
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


class Help(argparse.RawDescriptionHelpFormatter):
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


def port(text: str) -> int:
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


def check_out_dir(path: str | Path) -> Path:
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


def existing_run(path: str, overwrite: bool) -> list[Path]:
    """What a run already wrote in --out: refused unless --overwrite (then it is to be removed)."""
    out = Path(path)
    marks = [n for n in _RUN_MARKS if (out / n).exists()]
    if marks and not overwrite:
        raise ConfigError(
            f"--out {out} holds a run already ({', '.join(marks)}): use --resume "
            f"{out} to continue it or --overwrite to replace it"
        )
    return [out / n for n in _RUN_OUTPUTS if (out / n).exists()] if marks else []


def remove(paths: list[Path]) -> None:
    """Remove the old run's files and folders (only what a run writes: other files stay)."""
    for target in paths:
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def check_model(name: str) -> None:
    from ..train.model import PRESETS, unknown_preset

    if name not in PRESETS and not name.startswith("hf:"):  # hf: names are checked by lowcomm.hf
        raise ConfigError(unknown_preset(name))


def config_values(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_toml(args.config))
    values.update(parse_overrides(args.overrides or []))
    for key in ("model", "steps", "ranks_per_worker", "faults", "replay"):
        v = getattr(args, key, None)
        if v is not None:
            values[key] = v
    return values


def check_data(spec: str) -> None:
    """A missing corpus path named now (the full data check runs in the launcher)."""
    if spec in ("stdlib", "") or spec.startswith("hf:"):
        return
    from ..train.data import _split_dtype

    path, _ = _split_dtype(spec)
    if not path.exists():
        raise ConfigError(
            f"data path {path} does not exist: give a text file, a folder, a .bin "
            f"token file, hf:NAME, or data=stdlib"
        )


def command_line() -> str:
    """This process's command line, as a user would type it (for results.md and plots)."""
    return " ".join(["lowcomm", *sys.argv[1:]])


_MODEL_HELP = (
    f"model preset: tiny, small, base, 85m, or a Hugging Face causal LM: hf:ARCH[:PRESET] "
    f"(llama, gpt2, qwen2, ...) or hf:PATH (default: {TrainConfig.model}, the model key)"
)
_STEPS_HELP = f"inner steps per worker (default: {TrainConfig.steps}, the steps key)"


def add_model_and_steps(p: argparse.ArgumentParser) -> None:
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


def add_config_port_overrides(p: argparse.ArgumentParser) -> None:
    """--config, --port and the key=value overrides, shared by train and compare."""
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="TOML file of config keys (default: none)",
    )
    p.add_argument("--port", type=port, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
