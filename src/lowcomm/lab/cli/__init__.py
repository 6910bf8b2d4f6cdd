"""The lab's commands of ``lowcomm``: ``compare`` and ``report`` (:mod:`.compare`),
``simulate`` and ``bench`` (:mod:`.tools`)."""

from __future__ import annotations

from lowcomm.cli import register_command

from .compare import _add_compare, _add_report
from .tools import _add_bench, _add_simulate


def register() -> None:
    """Add the lab's commands to ``lowcomm``."""
    register_command("compare", _add_compare)
    register_command("report", _add_report)
    register_command("simulate", _add_simulate)
    register_command("bench", _add_bench, own_args=True)  # it passes key=value on to its runs
