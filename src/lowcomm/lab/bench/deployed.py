"""An elastic run as it is deployed, on one machine: a standalone lighthouse and one command per
site (``torchrun --nproc-per-node R ... site=N``), each site into its own folder and, given a
:class:`~lowcomm.lab.netshape.network.ShapedNetwork` of ``per-worker`` topology, in a network
namespace of its own with its own address (a "machine"), the lighthouse in the switch's. Used by
the deployed fault campaign (:mod:`.chaos_sites`), ``lowcomm bench sites`` and the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOWCOMM = [sys.executable, "-m", "lowcomm.lab"]


class Deployment:
    """The lighthouse and the sites' commands of one run; ``train(site, lighthouse)`` gives a
    site's ``lowcomm train`` arguments (the same each time it is started)."""

    def __init__(
        self,
        root: Path,
        ranks: int,
        train: Callable[[int, str], list[str]],
        net: Any = None,
        timeout_s: float = 10.0,
        secret_file: str = "",
    ) -> None:
        from lowcomm.train.ports import free_port

        root.mkdir(parents=True, exist_ok=True)
        self.root, self.ranks, self.train, self.net = root, ranks, train, net
        self.timeout_s = timeout_s
        self.secret_file = secret_file  # a keyed run's: its lighthouse serves behind the front
        self.port = free_port(host="")
        self.host = net.switch_addr if net is not None else "127.0.0.1"
        self.address = f"{self.host}:{self.port}"  # the lighthouse, as the sites reach it
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, int] = {}  # how many times each site's command was run
        self.lighthouse = self.start_lighthouse()

    def start_lighthouse(self) -> subprocess.Popen:
        """The lighthouse at its fixed address (started again there after a kill)."""
        argv = [
            *LOWCOMM,
            "lighthouse",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--timeout-s",
            f"{self.timeout_s:g}",
            "--heartbeat-timeout-s",
            "1",
            *(["--secret-file", self.secret_file] if self.secret_file else []),
        ]
        if self.net is not None:
            argv = ["ip", "netns", "exec", self.net.switch, *argv]
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "lighthouse at" not in line:
            raise RuntimeError(f"the lighthouse did not start: {line}{proc.stdout.read()[-500:]}")
        self.lighthouse = proc
        return proc

    def out(self, site: int) -> Path:
        """Site ``site``'s own folder."""
        return self.root / f"site{site}"

    def command(self, site: int) -> list[str]:
        """Site ``site``'s own command, as its machine would run it."""
        argv = [  # torchrun, from this interpreter (its script need not be on PATH)
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(self.ranks),
            "-m",
            "lowcomm.lab",
            *self.train(site, self.address),
            "--out",
            str(self.out(site)),
        ]
        if self.net is None:
            return argv
        # its data plane on its own address; its ranks' own traffic on its loopback
        env = ["env", f"LOWCOMM_ADDR={self.net.address(site)}", "GLOO_SOCKET_IFNAME=lo"]
        return ["ip", "netns", "exec", self.net.namespace(site), *env, *argv]

    def start(self, site: int) -> None:
        """Site ``site``'s command (again): its own session and log."""
        n = self.started.get(site, 0)
        self.started[site] = n + 1
        with open(self.root / f"site{site}.{n}.log", "w") as log:
            self.procs[site] = subprocess.Popen(
                self.command(site), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def syncs(self, site: int) -> int:
        """How many syncs site ``site`` has logged (over all its starts)."""
        path = self.out(site) / "sites" / f"site{site}.syncs.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def rank_pid(self, site: int, rank: int) -> int | None:
        """The process of ``rank`` of ``site`` (a child of its torchrun); None if gone."""
        kids = subprocess.run(
            ["pgrep", "-P", str(self.procs[site].pid)], capture_output=True, text=True
        ).stdout.split()
        for pid in kids:
            with contextlib.suppress(OSError):
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in env:
                    return int(pid)
        return None

    def lose(self, site: int) -> None:
        """Site ``site``'s machine lost: SIGKILL of its torchrun and of every rank (torchrun
        starts each rank in a session of its own, so a kill of its process group leaves them
        running)."""
        root = self.procs[site].pid
        tree, todo = [root], [root]
        while todo:
            kids = subprocess.run(
                ["pgrep", "-P", str(todo.pop())], capture_output=True, text=True
            ).stdout.split()
            tree += [int(k) for k in kids]
            todo += [int(k) for k in kids]
        for pid in tree:  # torchrun first: an orphaned rank is not started again
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs[site].wait()

    def log(self, site: int) -> str:
        """Everything site ``site``'s commands printed."""
        return "\n".join(p.read_text() for p in sorted(self.root.glob(f"site{site}.*.log")))

    def close(self) -> None:
        """Every process left (a stopped one too), and the lighthouse."""
        for p in [*self.procs.values(), self.lighthouse]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if self.lighthouse.stdout is not None:
            self.lighthouse.stdout.close()
