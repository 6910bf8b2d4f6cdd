"""The lighthouse of an elastic run that the launcher started: a process of its own at an
address fixed for the whole run, started again there when it dies (or, restarted on purpose,
after the seconds asked).

A restarted lighthouse knows nothing of the run: the sites re-register with their next
heartbeat, ask their pending quorum again (:meth:`lowcomm.elastic.membership.Membership.quorum`
retries for ``timeout_s``) and name their groups with a new epoch, so the new lighthouse's
quorum ids, which start again from 1, never meet an old group's store keys.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .ports import free_port

_UP_S = 30.0  # bound on a (re)started lighthouse's process listening on its port


def serve(
    bind: str,
    options: dict[str, int],
    secret: bytes | None,
    run_id: str = "",
) -> tuple[Any, Any]:
    """torchft's lighthouse at ``bind`` (HOST:PORT); with a run ``secret``, on loopback behind
    an authenticating :class:`~lowcomm.elastic.front.Front` at ``bind`` instead, which forwards
    only requests and beats sealed under it (``run_id``: of that run only). Both are held by
    the caller (dropped, they stop)."""
    from torchft.coordination import LighthouseServer

    if secret is None:
        return LighthouseServer(bind=bind, **options), None
    from ..elastic.front import Front

    server = LighthouseServer(bind="127.0.0.1:0", **options)
    upstream = server.address().rsplit(":", 1)[1]
    runs = frozenset([run_id]) if run_id else None
    lapse_s = options.get("heartbeat_timeout_ms", 2000) / 1000
    front = Front(f"127.0.0.1:{upstream}", secret, bind, runs, lapse_s)
    front.start()
    return server, front


def _serve(
    port: int, options: dict[str, int], setup: Callable[[], None] | None, up: Any, front: tuple
) -> None:
    """The lighthouse's process: serve until killed (RUST_LOG=warn: see :class:`Keeper`),
    after ``setup`` (a network namespace to serve in, say), behind a front if ``front``
    (secret, run id) holds a secret; ``up`` is set once it listens."""
    from ..elastic.messages import quiet_junk

    quiet_junk()
    # Ctrl-C reaches the whole process group: the launcher stops this process itself, after
    # the sites (a KeyboardInterrupt here would only print a traceback into the run's output)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if setup is not None:
        setup()
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
        setup: Callable[[], None] | None = None,
        host: str = "",
        secret: bytes | None = None,
        run_id: str = "",
    ) -> None:
        if not os.environ.get("LOWCOMM_DEBUG"):  # the sites' clients log at INFO too
            os.environ.setdefault("RUST_LOG", "warn")  # (sites inherit it: set before any fork)
        self.ctx, self.options, self.out_dir = ctx, options, out_dir
        # ``setup``: what its process runs first (the namespace it serves in, when the sites
        # have namespaces of their own), and ``host``: its address there
        self.setup = setup
        self.port = free_port(host="")  # every interface: the sites may be on other machines
        self.address = f"http://{host or socket.gethostname()}:{self.port}"
        self._proc: Any = None
        # a keyed run's lighthouse serves behind a front that takes this run's requests only
        self.front = (secret, run_id)
        self._back_at: float | None = None  # when a lighthouse restarted on purpose is back

    def start(self) -> None:
        """Start the lighthouse's process and wait until it listens (at most ``_UP_S``)."""
        up = self.ctx.Event()
        self._proc = self.ctx.Process(
            target=_serve, args=(self.port, self.options, self.setup, up, self.front), daemon=True
        )
        self._proc.start()
        deadline = time.monotonic() + _UP_S
        while time.monotonic() < deadline and self._proc.exitcode is None:
            if up.wait(0.05):
                return
        raise RuntimeError(f"the lighthouse did not start at {self.address} within {_UP_S:g} s")

    def restart(self, after_s: float) -> None:
        """Stop the lighthouse now; :meth:`tick` starts it again ``after_s`` seconds later, at
        the same address (the sites ask their pending quorums again meanwhile)."""
        self._proc.kill()
        self._proc.join()
        self._back_at = time.monotonic() + after_s

    def tick(self) -> None:
        """Start a dead lighthouse again (one restarted on purpose, once its time is up)."""
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
