"""Running ``ip`` and ``tc``, and the life of network namespaces: create, list, empty, delete.

Namespaces made here are named ``{prefix}-{pid}-...``, so those of a run that died can be told
apart from those of a live one and removed (:func:`cleanup_stale`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable

from .errors import NetworkUnavailable
from .units import TBF_LATENCY


class CommandFailed(RuntimeError):
    """An ``ip`` or ``tc`` command exited non-zero (the message holds its stderr)."""


def run(argv: list[str], timeout: float = 20.0) -> str:
    """Run ``argv`` and return its stdout; :class:`CommandFailed` on a non-zero exit."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise NetworkUnavailable(f"{argv[0]!r} not found; install iproute2") from e
    if done.returncode != 0:
        raise CommandFailed(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Names of every network namespace (empty when ``ip`` is unavailable)."""
    try:
        out = run(["ip", "netns", "list"])
    except (CommandFailed, NetworkUnavailable):
        return []
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespace_pids(ns: str) -> list[int]:
    try:
        out = run(["ip", "netns", "pids", ns])
    except (CommandFailed, NetworkUnavailable):
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has exited and only waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_namespace_processes(ns: str, grace_s: float = 1.0) -> None:
    """Stop what still runs inside ``ns`` (workers of this run), so the namespace really dies."""
    own = {os.getpid(), os.getppid()}
    pids = [p for p in _namespace_pids(ns) if p not in own]
    if not pids:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.02)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return


def delete_namespace(ns: str, kill_leftovers: bool = True) -> None:
    """Delete ``ns``, first stopping processes inside it unless ``kill_leftovers`` is False."""
    if kill_leftovers:
        _kill_namespace_processes(ns)
    try:
        run(["ip", "netns", "del", ns])
    except CommandFailed:
        if ns in list_namespaces():
            raise


def delete_namespaces(names: Iterable[str], kill_leftovers: bool = True) -> list[str]:
    """Delete each namespace in turn, going on past failures; what failed, one line each."""
    errors = []
    for ns in names:
        try:
            delete_namespace(ns, kill_leftovers=kill_leftovers)
        except (CommandFailed, NetworkUnavailable) as e:
            errors.append(str(e))
    return errors


def enter(ns: str) -> None:
    """Move this process (its calling thread, before it starts others) into namespace ``ns``:
    every socket it opens from now on lives there. For a process started for that namespace
    (``ip netns exec`` for one that is already running Python)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise NetworkUnavailable(f"cannot enter network namespace {ns}: {os.strerror(err)}")


def require_root_and_iproute2() -> None:
    """Raise :class:`NetworkUnavailable` unless this process is root with ``ip`` and ``tc``."""
    if os.geteuid() != 0:
        raise NetworkUnavailable(
            "shaped networks need root (network namespaces and tc); run as root, e.g. with sudo, "
            "or skip the network benchmarks"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetworkUnavailable(
                f"'{tool}' not found on PATH; install iproute2 (apt-get install iproute2)"
            )


def check_prerequisites() -> None:
    """Raise :class:`NetworkUnavailable` unless namespaces, veth, bridge and tbf all work here."""
    require_root_and_iproute2()
    probe = f"lowcomm-{os.getpid()}-probe{threading.get_ident() % 10000}"
    other = probe + "b"
    step = "create a network namespace (`ip netns add`)"
    try:
        run(["ip", "netns", "add", probe])
        step = "add a tbf qdisc (`tc qdisc add ... tbf`, kernel module sch_tbf)"
        run(
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "10mbit",
                "burst",
                "131072",
                "latency",
                TBF_LATENCY,
            ]
        )
        step = "create a bridge (kernel module bridge)"
        run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
        step = "create a veth pair between namespaces (kernel module veth)"
        run(["ip", "netns", "add", other])
        run(
            [
                "ip",
                "-n",
                probe,
                "link",
                "add",
                "v0",
                "type",
                "veth",
                "peer",
                "name",
                "v1",
                "netns",
                other,
            ]
        )
    except CommandFailed as e:
        raise NetworkUnavailable(
            f"cannot {step}: {e}. Shaped networks need a kernel with network namespaces, veth, "
            "bridge and sch_tbf, and permission to use them (root, not inside a restricted "
            "container); skip the network benchmarks here"
        ) from e
    finally:
        for ns in (other, probe):
            try:
                delete_namespace(ns)
            except (CommandFailed, NetworkUnavailable):
                pass


def cleanup_stale(prefix: str = "lowcomm", *, include_live: bool = False) -> list[str]:
    """Delete namespaces left behind by killed runs; returns the names it deleted.

    Names are ``{prefix}-{pid}-...``; a namespace is stale when that pid no longer runs (or
    always, with ``include_live=True``). Processes still inside a stale namespace are stopped.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    removed = []
    for ns in list_namespaces():
        m = pattern.match(ns)
        if m is None:
            continue
        pid = int(m.group(1))
        if not include_live and (pid == os.getpid() or alive(pid)):
            continue
        try:
            delete_namespace(ns)
            removed.append(ns)
        except (CommandFailed, NetworkUnavailable):
            pass
    return removed
