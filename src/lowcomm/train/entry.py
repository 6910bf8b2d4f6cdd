"""The top of every worker process the local launchers start (fixed world or elastic sites):
Ctrl-C leaves at once, and a user error becomes one line in a file the launcher reports."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import LowCommError, MembershipError


def run_entry(out_dir: str, rank: int | str, train: Callable[[], Any]) -> Any:
    """Run ``train`` as a launched worker of rank (or site) ``rank``.

    Ctrl-C reaches every worker (the terminal signals the whole group): leave at once and
    quietly; the launcher reports where the run stopped. A user error found inside a worker
    exits 2 (a site that cannot go on with the run: 1) with no traceback; every worker usually
    hits the same one, so the launcher prints each distinct message once (:func:`user_errors`).
    """
    os.environ["LOWCOMM_LAUNCHED"] = "1"
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    try:
        return train()
    except (LowCommError, FileNotFoundError) as e:
        try:
            error_file(out_dir, rank).write_text(str(e))
        except OSError:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1 if isinstance(e, MembershipError) else 2)
    except Exception:  # a bug, or the backend's own failure: its whole stack, beside the run
        with contextlib.suppress(OSError):
            trace_file(out_dir, rank).write_text(traceback.format_exc())
        raise


def trace_file(out_dir: str | Path, rank: str | int) -> Path:
    """Where worker ``rank`` leaves the stack of an unexpected failure (the launcher's error
    line names it)."""
    return Path(out_dir) / f"traceback-rank{rank}.txt"


def failure_of(out_dir: str | Path, rank: str | int) -> str | None:
    """'<the exception's last line> (its stack: <file>)' where worker ``rank`` left its stack
    (None where it left none)."""
    path = trace_file(out_dir, rank)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    return f"{lines[-1].strip() if lines else 'no message'} (its stack: {path})"


def clear_stale(out_dir: Path) -> None:
    """Remove the error and stack files an earlier launch into ``out_dir`` left (a launcher
    that was killed reads none of them)."""
    for stale in [*out_dir.glob(".error-rank*"), *out_dir.glob("traceback-rank*.txt")]:
        stale.unlink(missing_ok=True)


def error_file(out_dir: str | Path, rank: str | int) -> Path:
    """Where worker ``rank`` leaves the one line of its user error."""
    return Path(out_dir) / f".error-rank{rank}"


def user_errors(out_dir: Path) -> str:
    """The distinct messages the workers left in their error files (which are then removed)."""
    messages: list[str] = []
    for f in sorted(out_dir.glob(".error-rank*")):
        with contextlib.suppress(OSError):
            text = f.read_text().strip()
            f.unlink()
            if text and text not in messages:
                messages.append(text)
    return "; ".join(messages)
