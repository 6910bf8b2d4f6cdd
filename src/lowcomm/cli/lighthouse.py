"""``lowcomm lighthouse``: a standalone lighthouse at a fixed address, the service the sites of
elastic runs started on other machines point at (``lighthouse=HOST:PORT``).

It is torchft's ``LighthouseServer`` with the settings ``lowcomm train`` gives its own. It keeps
no state a restart would lose that the sites cannot give it again: started again at the same
address (by hand, a supervisor, Kubernetes), the sites re-register with their next heartbeat and
ask their pending quorum again (docs/reliability.md, "The lighthouse dies").
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import threading
from typing import Any


def _add_lighthouse(sub: Any) -> None:
    h = sub.add_parser(
        "lighthouse", help="run a lighthouse at a fixed address for elastic sites elsewhere"
    )
    h.add_argument("--port", type=int, default=29510, help="TCP port to listen on (29510)")
    h.add_argument(
        "--host",
        default="::",
        help="the address to listen on (:: = every "
        "interface; give a private one, e.g. a WireGuard address, to keep it off "
        "the others)",
    )
    h.add_argument(
        "--rounds",
        choices=("lockstep", "quorum"),
        default="lockstep",
        help="the runs' rounds= (quorum: it gathers askers for 0.5 s)",
    )
    h.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="the runs' timeout_s (lock-step: a quorum waits so long)",
    )
    h.add_argument(
        "--secret-file",
        default="",
        help="the runs' secret (else $LOWCOMM_SECRET): only requests sealed under it reach "
        "the lighthouse (an authenticating front; the lighthouse itself on loopback)",
    )
    h.add_argument(
        "--run-id",
        default="",
        help="with a secret: serve this run only (the sites' run_id=); a request of another run "
        "of the secret, even a fresh one, is refused (without it, every run of the secret)",
    )
    h.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=2.0,
        help="a site silent this long is left out of the next quorum (2)",
    )
    h.set_defaults(func=cmd_lighthouse)


def cmd_lighthouse(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM (exit 0); a port in use or no torchft: one line, exit 2."""
    from ..config import ConfigError
    from ..elastic.admission import read_secret
    from ..elastic.rounds import LIGHTHOUSE_JOIN_S
    from ..train.lighthouse import serve

    _check_port(args.port, args.host)
    if args.timeout_s <= 0 or args.heartbeat_timeout_s <= 0:
        raise ConfigError("--timeout-s and --heartbeat-timeout-s must be > 0 seconds")
    if not os.environ.get("LOWCOMM_DEBUG"):
        os.environ.setdefault("RUST_LOG", "warn")  # it logs every quorum at INFO (read on import)
    try:
        import torchft.coordination  # noqa: F401 (its lighthouse, imported by serve)
    except ImportError:
        raise ConfigError(
            "the lighthouse is torchft's: pip install 'lowcomm[torchft]' (a pinned torchft)"
        ) from None
    join_s = LIGHTHOUSE_JOIN_S if args.rounds == "quorum" else args.timeout_s
    options = {
        "min_replicas": 1,
        "join_timeout_ms": int(join_s * 1000),
        "quorum_tick_ms": 20,
        "heartbeat_timeout_ms": int(args.heartbeat_timeout_s * 1000),
    }
    secret = read_secret(args.secret_file)
    if args.run_id:  # the sites' run_id= rule: a name no site could carry is refused
        from ..elastic.messages import check_run_id

        try:
            check_run_id(args.run_id)
        except ConfigError as err:
            raise ConfigError(f"--run-id: {err}") from None
    if args.run_id and secret is None:
        raise ConfigError(
            "--run-id restricts a keyed lighthouse's front to one run: give the secret too "
            "(--secret-file FILE, or $LOWCOMM_SECRET)"
        )
    if secret is not None:
        try:
            import grpc  # noqa: F401 (the front speaks the lighthouse's gRPC)
        except ImportError:
            raise ConfigError(
                "a keyed lighthouse serves behind a front that needs grpcio: pip install "
                "'lowcomm[torchft]'"
            ) from None
        from ..elastic.messages import quiet_junk

        quiet_junk()
    try:
        server, front = serve(_bind(args.host, args.port), options, secret, args.run_id)
    except OSError as e:
        raise ConfigError(f"the lighthouse cannot listen on {args.host}:{args.port}: {e}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    where = socket.gethostname() if args.host in ("::", "0.0.0.0") else args.host
    where = f"[{where}]" if ":" in where else where
    keyed = "; only requests sealed under the secret reach it" if front is not None else ""
    if front is not None and args.run_id:
        keyed = f"; only run {args.run_id}'s requests sealed under the secret reach it"
    print(
        f"lowcomm: lighthouse at http://{where}:{args.port} (rounds="
        f"{args.rounds}){keyed}; point the sites at it with lighthouse=HOST:{args.port}; "
        f"Ctrl-C stops it",
        flush=True,
    )
    stop.wait()
    if front is not None:
        print(
            f"lowcomm: the front refused {front.refused} requests and dropped "
            f"{front.dropped} unsealed or stale beats",
            flush=True,
        )
        front.stop()
    server.shutdown()
    print("lowcomm: lighthouse stopped", flush=True)
    return 0


def _bind(host: str, port: int) -> str:
    """The lighthouse's bind address: an IPv6 one in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_port(port: int, host: str = "::") -> None:
    """ConfigError when ``port`` is no TCP port or is taken, or ``host`` is no address of this
    machine (the sites need this very one)."""
    from ..config import ConfigError

    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port: give 1-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:  # as the lighthouse binds: reusing the address of one just gone (TIME_WAIT)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except socket.gaierror:
        raise ConfigError(f"--host {host} is no address: give an IP of this machine") from None
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"--host {host} is no address of this machine: give one of its IPs (ip addr)"
            ) from None
        raise ConfigError(
            f"port {port} is in use (a lighthouse already there?): stop what holds it, or "
            f"pass another --port and point the sites at that"
        ) from None
