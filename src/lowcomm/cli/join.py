"""``lowcomm join DIR``: start one more site of the elastic run going in DIR (a site that left,
started again by hand on this machine); it joins at the run's next sync and heals from a live
peer."""

from __future__ import annotations

import argparse
from typing import Any


def _add_join(sub: Any) -> None:
    j = sub.add_parser(
        "join",
        help="start a site of the elastic run going in DIR again (it heals from a live peer)",
    )
    j.add_argument("dir", metavar="DIR", help="the --out folder of a running elastic run")
    j.add_argument(
        "--site",
        type=int,
        default=None,
        help="the site number to take (default: the lowest one no live process holds)",
    )
    j.set_defaults(func=cmd_join)


def cmd_join(args: argparse.Namespace) -> int:
    """`lowcomm join DIR [--site N]`: runs the site until the run ends (exit 0)."""
    from ..train.join_site import join_site

    join_site(args.dir, args.site)
    return 0
