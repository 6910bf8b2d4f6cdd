"""Where a result came from: the source tree's git revision, stamped on summaries and reports
(the trainer writes it, the benchmark reports print it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_rev() -> str:
    """The source tree's git revision (with -dirty), LOWCOMM_GIT_REV if set, or 'unknown'."""
    if os.environ.get("LOWCOMM_GIT_REV"):  # benchmarks run from a snapshot of the tree
        return os.environ["LOWCOMM_GIT_REV"]
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=5
        ).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
