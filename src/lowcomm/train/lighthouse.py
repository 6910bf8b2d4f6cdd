"""The lighthouse of an elastic run that the launcher started: a process of its own at an
address fixed for the whole run, started again there when it dies (or when a ``lighthouse:``
fault killed it, after that fault's seconds).

A restarted lighthouse knows nothing of the run: the sites re-register with their next
heartbeat, ask their pending quorum again (:meth:`lowcomm.elastic.membership.Membership.quorum`
retries for ``timeout_s``) and name their groups with a new epoch, so the new lighthouse's
quorum ids, which start again from 1, never meet an old group's store keys.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from ..faults import LIGHTHOUSE_FAULT
from .ports import free_port

_UP_S = 30.0  # bound on a (re)started lighthouse's process listening on its port
LIGHTHOUSE_NAMES = ".lighthouse_names"  # (in the run's folder) see Keeper


def serve(
    bind: str,
    options: dict[str, int],
    secret: bytes | None,
    run_id: str = "",
    names_file: Path | None = None,
) -> tuple[Any, Any]:
    """torchft's lighthouse at ``bind`` (HOST:PORT); with a run ``secret``, on loopback behind
    an authenticating :class:`~lowcomm.elastic.front.Front` at ``bind`` instead, which forwards
    only requests sealed under it (``run_id``: of that run only; ``names_file``: where it keeps
    the names that asked). Both are held by the caller (dropped, they stop)."""
    from torchft.coordination import LighthouseServer

    if secret is None:
        return LighthouseServer(bind=bind, **options), None
    from ..elastic.front import Front

    server = LighthouseServer(bind="127.0.0.1:0", **options)
    upstream = server.address().rsplit(":", 1)[1]
    runs = frozenset([run_id]) if run_id else None
    front = Front(f"127.0.0.1:{upstream}", secret, bind, runs, names_file)
    front.start()
    return server, front


def _serve(port: int, options: dict[str, int], netns: str, up: Any, front: tuple) -> None:
    """The lighthouse's process: serve until killed (RUST_LOG=warn: see :class:`Keeper`),
    inside network namespace ``netns`` if one is named, behind a front if ``front`` (secret,
    run id, names file) holds a secret; ``up`` is set once it listens."""
    from ..elastic.messages import quiet_junk

    quiet_junk()
    # Ctrl-C reaches the whole process group: the launcher stops this process itself, after
    # the sites (a KeyboardInterrupt here would only print a traceback into the run's output)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if netns:
        from ..netshape.namespaces import enter

        enter(netns)
    held = serve(f"[::]:{port}", options, *front)
    up.set()
    while held:
        time.sleep(3600)


class Keeper:
    """The run's lighthouse: started by :meth:`start`, watched by :meth:`tick` (the launcher's
    wait loop calls it every 0.2 s), ended by :meth:`stop`."""

    def __init__(
        self,
        ctx: Any,
        options: dict[str, int],
        out_dir: Path,
        netns: str = "",
        host: str = "",
        secret: bytes | None = None,
        run_id: str = "",
    ) -> None:
        if not os.environ.get("LOWCOMM_DEBUG"):  # the sites' clients log at INFO too
            os.environ.setdefault("RUST_LOG", "warn")  # (sites inherit it: set before any fork)
        self.ctx, self.options, self.out_dir = ctx, options, out_dir
        # ``netns``: the namespace it serves in (sites in namespaces of their own), at ``host``
        self.netns = netns
        self.port = free_port(host="")  # every interface: the sites may be on other machines
        self.address = f"http://{host or socket.gethostname()}:{self.port}"
        self._proc: Any = None
        # a keyed run's lighthouse serves behind a front that takes this run's requests only,
        # and keeps the names that asked (a restarted one still knows whose beats count)
        self.front = (secret, run_id, out_dir / LIGHTHOUSE_NAMES)
        self._back_at: float | None = None  # a lighthouse: fault's restart time

    def start(self) -> None:
        """Start the lighthouse's process and wait until it listens (at most ``_UP_S``)."""
        up = self.ctx.Event()
        self._proc = self.ctx.Process(
            target=_serve, args=(self.port, self.options, self.netns, up, self.front), daemon=True
        )
        self._proc.start()
        deadline = time.monotonic() + _UP_S
        while time.monotonic() < deadline and self._proc.exitcode is None:
            if up.wait(0.05):
                return
        raise RuntimeError(f"the lighthouse did not start at {self.address} within {_UP_S:g} s")

    def tick(self) -> None:
        """Act on a site's ``lighthouse:`` request; start a dead lighthouse again."""
        ask = self.out_dir / LIGHTHOUSE_FAULT
        with contextlib.suppress(OSError):
            seconds = float(ask.read_text().strip() or 0)
            self._proc.kill()
            self._proc.join()
            self._back_at = time.monotonic() + seconds
            ask.unlink()
            print(
                f"lowcomm: fault: the lighthouse is killed; it starts again in {seconds:g} s",
                flush=True,
            )
        if self._proc.exitcode is None:
            return
        if self._back_at is None:  # died by itself (or killed from outside): at once
            code = self._proc.exitcode
            why = f"signal {-code}" if code < 0 else f"exit {code}"
            print(
                f"lowcomm: the lighthouse is gone ({why}); starting it again at {self.address}",
                flush=True,
            )
        elif time.monotonic() < self._back_at:
            return
        self._back_at = None
        self.start()
        print(f"lowcomm: the lighthouse is back at {self.address}", flush=True)

    def stop(self) -> None:
        """End the lighthouse's process (the run is over)."""
        if self._proc is not None and self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()
        (self.out_dir / LIGHTHOUSE_FAULT).unlink(missing_ok=True)
        (self.out_dir / LIGHTHOUSE_NAMES).unlink(missing_ok=True)
