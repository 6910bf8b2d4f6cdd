"""``python -m lowcomm.lab.netshape``: set up a shaped network, measure it, print, tear down."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .errors import LinkCheckFailed, NetworkUnavailable
from .namespaces import check_prerequisites, cleanup_stale
from .network import ShapedNetwork


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m lowcomm.lab.netshape",
        description="Set up a kernel-shaped network, measure it, print, tear it down.",
    )
    parser.add_argument("--rate", default="50mbit", help="tc-style rate, e.g. 50mbit, 1gbit")
    parser.add_argument("--topology", choices=["shared", "per-worker"], default="shared")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--burst", default=None, help="bucket depth, e.g. 64kb (default: auto)")
    parser.add_argument(
        "--mtu",
        type=int,
        default=None,
        help="MTU of the shaped device (default 1500; 65536 keeps loopback's)",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each measurement")
    parser.add_argument("--repeat", type=int, default=1, help="measurements to take")
    parser.add_argument("--no-check", action="store_true", help="skip the link check on entry")
    parser.add_argument(
        "--hold",
        action="store_true",
        help="keep the network up until Ctrl-C (prints how to enter it)",
    )
    parser.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="delete namespaces of dead runs (prefix lowcomm) and exit",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _report(net: ShapedNetwork, args: argparse.Namespace, results: list[float]) -> None:
    """Print what was set up and measured, as one JSON object or one line."""
    if args.json:
        print(
            json.dumps(
                {
                    "rate": args.rate,
                    "requested_mbit": net.rate_bps / 1e6,
                    "topology": net.topology,
                    "workers": net.workers,
                    "burst_bytes": net.burst_bytes,
                    "mtu": net.mtu,
                    "check_mbit": net.measured_mbit,
                    "measured_mbit": results,
                    "namespaces": net.namespaces,
                    "master_addr": net.master_addr,
                }
            )
        )
        return
    got = ", ".join(f"{m:.1f}" for m in results)
    print(
        f"{net.topology} x{net.workers} at {args.rate} "
        f"(requested {net.rate_bps / 1e6:g} Mbit/s, burst {net.burst_bytes} B): "
        f"measured {got} Mbit/s"
    )


def _hold(net: ShapedNetwork) -> None:
    """Keep the network up until interrupted, saying how to enter each namespace."""
    for r in range(net.workers):
        print(f"rank {r}: {' '.join(net.command(r, ['bash']))}  (address {net.address(r)})")
    print("holding; Ctrl-C tears down", flush=True)
    while True:
        time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit status 0, 2 for an unusable network or bad input, 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        if args.cleanup_stale:
            removed = cleanup_stale("lowcomm")
            print(
                json.dumps(removed)
                if args.json
                else ("removed: " + " ".join(removed) if removed else "nothing stale")
            )
            return 0
        check_prerequisites()
        with ShapedNetwork(
            args.rate,
            args.topology,
            args.workers,
            burst=args.burst,
            mtu=args.mtu,
            check=not args.no_check,
        ) as net:
            results = [net.measure(seconds=args.seconds) for _ in range(args.repeat)]
            _report(net, args, results)
            if args.hold:
                _hold(net)
    except (NetworkUnavailable, LinkCheckFailed, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
