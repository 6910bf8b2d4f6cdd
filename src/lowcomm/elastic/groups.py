"""Each quorum's data-plane group: its store prefix, the members' arrival at it (bounded by
``connect_s``), and which members cannot be reached when it fails (the commit vote says so)."""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .decide import View


def group_name(run_id: str, view: View, generation: int) -> str:
    """The store prefix of ``view``'s group for attempt ``generation``: the run, the
    lighthouse's epoch (a restarted lighthouse counts quorum ids from the start again), the
    quorum, the attempt and the member processes."""
    return f"{run_id}/e{view.epoch}/q{view.quorum_id}/g{generation}/m{view.who}/"


def arrive(store: Any, rank: int, size: int, connect_s: float) -> None:
    """Wait at most ``connect_s`` for every member to reach this group's store; raises
    RuntimeError (a failed attempt: the runner retries among those left) when one does not.

    A member lost after the quorum formed but before it connected would otherwise hold the
    others in gloo's own rendezvous for the whole collective timeout."""
    store.set(f"arrived/{rank}", b"1")
    keys = [f"arrived/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=connect_s))
    except RuntimeError as e:  # torch's DistStoreError is one
        try:
            away = [r for r in range(size) if r != rank and not store.check([keys[r]])]
        except RuntimeError:  # the store itself is gone: its host
            away = [0]
        raise Unreachable(
            f"members {away} of the group did not reach it within connect_s={connect_s:g} s "
            f"({str(e).splitlines()[0][:120]})",
            away,
        ) from None


def store_of(view: View, connect_s: float) -> dist.TCPStore:
    """A client of the group's store (its first member's), reached within ``connect_s``.
    :class:`Unreachable` when it is not (that member gone, or this site's network cut) names
    it and every other member whose own store this site cannot reach either: a site cut off
    names them all, one that only lost the store host names that one."""
    address = view.data[0].store
    host, port = address.rsplit(":", 1)
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=connect_s))
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError is a RuntimeError
        others = {r: d.store for r, d in enumerate(view.data) if r > 0}
        raise Unreachable(
            f"could not reach the group's store at {address} within connect_s={connect_s:g} s "
            f"({str(e).splitlines()[0][:120]})",
            [0, *unreachable(others, min(2.0, connect_s))],
        ) from None


def unreachable(stores: dict[int, str], timeout_s: float) -> list[int]:
    """Of ``stores`` (rank -> HOST:PORT), the ranks whose store takes no TCP connection from
    here within ``timeout_s`` (tried all at once, each on a thread of its own)."""

    def reach(address: str) -> bool:
        try:  # (an address that is no HOST:PORT is reached by nothing)
            host, port = address.rsplit(":", 1)
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
            return True
        except (OSError, ValueError):
            return False

    with ThreadPoolExecutor(max_workers=max(1, len(stores))) as pool:
        ok = dict(zip(stores, pool.map(reach, stores.values())))
    return sorted(r for r, fine in ok.items() if not fine)


def unanswered(stores: dict[int, str], timeout_s: float) -> list[int]:
    """Of ``stores`` (site -> HOST:PORT), those whose store does not answer a ping within
    ``timeout_s``: a process gone, or stopped (SIGSTOP: its kernel still takes connections,
    which :func:`unreachable` counts as reached, but nothing reads them). A store that answers
    in a way this does not read (another torch's protocol) counts as not answering."""

    def answers(address: str) -> bool:
        nonce = int.from_bytes(os.urandom(4), "little")
        try:
            host, port = address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
                sock.settimeout(timeout_s)
                sock.sendall(_PING + nonce.to_bytes(4, "little"))
                got = b""
                while len(got) < 4:
                    chunk = sock.recv(4 - len(got))
                    if not chunk:
                        return False
                    got += chunk
                return int.from_bytes(got, "little") == nonce
        except (OSError, ValueError):
            return False

    with ThreadPoolExecutor(max_workers=max(1, len(stores))) as pool:
        ok = dict(zip(stores, pool.map(answers, stores.values())))
    return sorted(s for s, fine in ok.items() if not fine)


# torch's TCPStore wire protocol: the client's validation (query 0 and the magic number), then
# a ping (query 13 and a nonce, which the store sends back)
_PING = bytes([0]) + (0x3C85F7CE).to_bytes(4, "little") + bytes([13])


def listening_store(host: str) -> tuple[dist.TCPStore, socket.socket]:
    """A store this site hosts, listening on ``host`` alone (torch's own listens on every
    interface); the socket it was handed must live as long as the store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
    )
    return store, sock


class Unreachable(RuntimeError):
    """Members of a new group that this member could not reach (group ranks): dead, stopped,
    or cut off on the data plane. The commit vote carries them (see :func:`_unreached`)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def gloo_group(
    store: Any, rank: int, size: int, timeout_s: float, host: str = ""
) -> dist.ProcessGroup:
    """A gloo ProcessGroup on ``store`` that torch's default world does not need to know;
    ``host``: the address its connections use (else gloo's default: GLOO_SOCKET_IFNAME, or
    the address of this machine's name)."""
    timeout = timedelta(seconds=timeout_s)
    Gloo = dist.ProcessGroupGloo
    if host:
        options = Gloo._Options()
        options._timeout = timeout
        options._devices = [Gloo.create_device(hostname=host)]
        backend = Gloo(store, rank, size, options)
    else:
        backend = Gloo(store, rank, size, timeout)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group
