"""A stranger at a running elastic run's lighthouse: a process of its own without the run's
secret that knows the run's names (they are what every quorum hands every participant) and
asks with torchft's own client. What ``lowcomm bench chaos`` draws beside its faults, and
what the trust benchmark acts out:

- ``flood``: quorum requests under a site's name from 8 threads, with empty data, for a time
  (the lighthouse keeps the last request per name: the site is displaced while it lasts);
- ``junk``: as the run starts, one request under each of three new names with data claiming
  the run (its id, a MAC that is not the run's);
- ``replay``: a member's sealed request captured from an earlier run (the campaign keeps the
  ones its strangers saw, DIR/captured.jsonl) sent under a site's current name, for a time;
- ``store``: once a quorum has shown it the members' store addresses, random keys written into
  every store, for a time (a group's keys sit under a prefix only the run's key derives);
- ``beat``: heartbeats under a site's name every 0.2 s, for a time: dead (the campaigns draw a
  site they kill), paused or alive, the lighthouse would wait for it (a keyed front drops
  them: they carry no seal).

Every quorum a stranger takes part in hands it the members' requests: it keeps them (one line
each, with the run id they name) for later replays.

A campaign runs each stranger as a process of its own (:func:`spawn`, ``python -m
lowcomm.lab.bench.stranger``): its noise (a store gone mid-write) stays in its own log, and it is
what the attack is, one more process on the network.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from lowcomm.elastic.messages import replica_name
from lowcomm.train.spec import saved_values

KINDS = ("flood", "junk", "replay", "store", "beat")
BEAT_S = 0.2  # a beat stranger's period (a site's own)
RUN_FILE = "elastic.json"  # what the launcher writes while the run goes (train/join_site.py)
RUN_ID_FILE = "site0/run_id"  # sites launched one by one: what site 0 keeps (train/launch.py)
THREADS = 8


class Stranger:
    """One stranger against the run going into ``out``: ``kind`` at site ``site``, from
    ``delay_s`` after the run's file appears, for ``seconds``; requests it sees kept in
    ``captured`` (a JSON-lines file shared by a campaign's strangers)."""

    def __init__(
        self,
        kind: str,
        out: Path,
        site: int,
        delay_s: float,
        seconds: float,
        captured: Path,
        lighthouse: str = "",
    ) -> None:
        self.kind, self.out, self.site = kind, out, site
        # sites launched one by one (no launcher's file): their lighthouse, and the run id
        # site 0 keeps in its folder (DIR/site0/run_id)
        self.lighthouse = lighthouse
        self.delay_s, self.seconds, self.captured = delay_s, seconds, captured
        self.stop = threading.Event()
        self.asked = 0  # requests sent
        self.seen: dict[str, dict[str, Any]] = {}  # requests seen in quorums, by name
        self.stores: set[str] = set()  # store addresses seen in quorums
        self.written = 0  # junk keys written into stores
        self.note = ""  # why it did nothing, if it did nothing
        self.run_id = ""  # the run's id, once found
        self.refused = 0  # requests a keyed lighthouse's front refused
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._local = threading.local()
        self._count = threading.Lock()  # asked and refused, from every thread
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's client logs each connection

    def start(self) -> None:
        """Wait for the run in the background, then act."""
        self._thread.start()

    def finish(self) -> dict[str, Any]:
        """Stop; what it did (its row in a campaign's results)."""
        self.stop.set()
        self._thread.join(timeout=30)
        self._keep()
        return {
            "kind": self.kind,
            "site": self.site,
            "delay_s": self.delay_s,
            "seconds": self.seconds,
            "asked": self.asked,
            "seen": len(self.seen),
            "stores": len(self.stores),
            "written": self.written,
            "run_id": self.run_id,
            "refused": self.refused,
            "note": self.note,
        }

    # -- acting ------------------------------------------------------------------------------
    def _run(self) -> None:
        run = self._wait_for_run()
        if run is None:
            return
        address, run_id = run
        if self.stop.wait(self.delay_s):
            return
        until = time.monotonic() + self.seconds
        if self.kind == "junk":
            for n in (9, 10, 11):
                data = {
                    "site": n,
                    "tag": "start",
                    "phase": "sync",
                    "gen": 0,
                    "join_from": 0,
                    "enter": True,
                    "run": run_id,
                    "fp": "x",
                    "name": replica_name(run_id, n),
                    "mac": "00" * 32,
                }
                self._ask(address, replica_name(run_id, n), data)
            return
        name = replica_name(run_id, self.site)
        if self.kind == "beat":
            self._beat(address, name, until)
            return
        if self.kind == "store":
            while not self.stores and not self.stop.is_set() and time.monotonic() < until:
                self._ask(address, f"{run_id}/stranger", {})  # a quorum shows the stores
            self._write_stores(until)
            return
        data = self._old_request(run_id) if self.kind == "replay" else {}
        if data is None:
            self.note = "no request of an earlier run captured yet: nothing to replay"
            return
        # a replay goes under the site's name here and, half the threads, under its own
        names = [name, data.get("name") or name] if self.kind == "replay" else [name]
        workers = [
            threading.Thread(
                target=self._keep_asking, args=(address, names[i % len(names)], data, until)
            )
            for i in range(THREADS)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()

    def _wait_for_run(self) -> tuple[str, str] | None:
        """The lighthouse address and run id of the run in ``out``, once its file is there
        (kept: a campaign records what a listener on the wire would have seen of the run)."""
        path = self.out / (RUN_ID_FILE if self.lighthouse else RUN_FILE)
        while not self.stop.is_set():
            try:
                if self.lighthouse:
                    self.run_id = path.read_text().strip()
                    return self.lighthouse, self.run_id
                record = json.loads(path.read_text())
                self.run_id = str(saved_values(record["run"])["run_id"])
                return record["lighthouse"], self.run_id
            except (OSError, ValueError, KeyError):
                time.sleep(0.05)
        self.note = f"the run never wrote {RUN_FILE}"
        return None

    def _keep_asking(self, address: str, name: str, data: dict[str, Any], until: float) -> None:
        while not self.stop.is_set() and time.monotonic() < until:
            self._ask(address, name, data)

    def _ask(self, address: str, name: str, data: dict[str, Any]) -> None:
        """One quorum request (a client per thread, made once); what the quorum showed, kept."""
        with self._count:
            self.asked += 1
        try:
            client = getattr(self._local, "client", None)
            if client is None:
                from torchft.coordination import LighthouseClient

                client = LighthouseClient(_url(address), connect_timeout=timedelta(seconds=2))
                self._local.client = client
            q = _quorum(client, name, data)
        except Exception as err:  # no quorum in its second, refused, or away: ask again
            with self._count:
                self.refused += "PermissionDenied" in str(err)
            time.sleep(0.05)
            return
        for m in q.participants:
            if isinstance(m.data, dict) and m.data.get("mac") and m.replica_id != name:
                self.seen[m.replica_id] = dict(m.data)
            if m.store_address:
                self.stores.add(m.store_address)

    def _beat(self, address: str, name: str, until: float) -> None:
        """Heartbeats under ``name`` until ``until`` (torchft's own client: no seal)."""
        from torchft.coordination import LighthouseClient

        client = None
        while not self.stop.is_set() and time.monotonic() < until:
            try:
                client = client or LighthouseClient(
                    _url(address), connect_timeout=timedelta(seconds=2)
                )
                client.heartbeat(name)
                with self._count:
                    self.asked += 1
            except Exception:  # the lighthouse away: beat again
                client = None
            self.stop.wait(BEAT_S)

    def _write_stores(self, until: float) -> None:
        """Random keys into every store seen, until ``until``."""
        from torch.distributed import TCPStore

        while not self.stop.is_set() and time.monotonic() < until:
            for where in sorted(self.stores):
                host, _, port = where.rpartition(":")
                try:
                    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=2))
                    for _ in range(50):
                        store.set(secrets.token_hex(8), secrets.token_bytes(64))
                        self.written += 1
                except Exception:  # a store gone with its group: the next one
                    continue
            time.sleep(0.2)

    # -- what it keeps -----------------------------------------------------------------------
    def _old_request(self, run_id: str) -> dict[str, Any] | None:
        """A sealed request captured from another run than ``run_id``, if any."""
        try:
            lines = self.captured.read_text().splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                data = json.loads(line)
            except ValueError:  # a line another campaign's writer left cut short
                continue
            if data.get("run") != run_id:
                return data
        return None

    def _keep(self) -> None:
        if self.seen:
            with open(self.captured, "a") as f:
                for data in self.seen.values():
                    f.write(json.dumps(data) + "\n")


def flood(address: str, name: str, data: dict[str, Any], stop: Any, threads: int) -> None:
    """Quorum requests under ``name`` with ``data`` from ``threads`` threads of their own, each
    asking again as soon as it is answered, until ``stop`` (an Event) is set; ``threads`` 0:
    one request, here. torchft's own client, as an outsider would use it (the trust findings'
    attack); nothing is counted or kept (:class:`Stranger` does that for the campaigns)."""
    from torchft.coordination import LighthouseClient

    def ask(again: bool) -> None:
        client = LighthouseClient(_url(address), connect_timeout=timedelta(seconds=5))
        while True:
            try:
                _quorum(client, name, data)
            except Exception:  # no quorum in its second, or refused: ask again
                pass
            if not again or stop.is_set():
                return

    if threads == 0:
        ask(False)
        return
    for _ in range(threads):
        threading.Thread(target=ask, args=(True,), daemon=True).start()


def _quorum(client: Any, name: str, data: dict[str, Any]) -> Any:
    """One quorum request under ``name``, as a site's own (one second to form)."""
    return client.quorum(
        replica_id=name,
        timeout=timedelta(seconds=1),
        address="",
        store_address="",
        step=0,
        world_size=1,
        shrink_only=False,
        data=data,
    )


def _url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


def heard(
    acted: dict[str, Any] | None, captured: Path, secret_file: str | Path, sites: int
) -> None:
    """After a keyed run a stranger watched (``acted``: what :func:`collect` gave): what a
    listener on the wire heard of it, for a later run's ``replay`` (see :func:`overheard`)."""
    from lowcomm.elastic.admission import read_secret

    if acted and acted.get("run_id") and secret_file:
        secret = read_secret(str(secret_file))
        assert secret is not None  # (read_secret raises for a file it cannot read)
        overheard(captured, acted["run_id"], secret, sites)


def overheard(captured: Path, run_id: str, secret: bytes, sites: int) -> None:
    """What a listener on the wire saw of run ``run_id`` (its sites' requests travel in the
    clear): one sealed request per site, appended to ``captured`` for a later run's ``replay``
    stranger. The campaign writes it, with the run's secret, as the run's sites would have."""
    from lowcomm.elastic.admission import Admission

    with open(captured, "a") as f:
        for site in range(sites):
            data = {
                "site": site,
                "tag": "sync@10",
                "phase": "sync",
                "gen": 0,
                "join_from": 0,
                "run": run_id,
                "fp": "f",
                "name": replica_name(run_id, site),
                "seq": time.time_ns(),
                "inc": "0",
                "store": "",
            }
            f.write(json.dumps(Admission(site, run_id, secret).seal(data)) + "\n")


def spawn(plan: dict[str, Any], out: Path, captured: Path, lighthouse: str = "") -> Any:
    """A stranger as a process of its own, as ``plan`` says (a schedule's: kind, site, delay_s,
    seconds), against the run going into ``out`` (its log and row beside it); :func:`collect`
    stops it and reads its row."""
    row = out.parent / f"{out.name}.stranger.json"
    row.unlink(missing_ok=True)
    _stop_file(row).unlink(missing_ok=True)
    log = open(out.parent / f"{out.name}.stranger.log", "w")  # noqa: SIM115 (the child's)
    what = [plan["kind"], str(out), str(plan["site"]), str(plan["delay_s"]), str(plan["seconds"])]
    args = [*what, str(captured), str(row), *([lighthouse] if lighthouse else [])]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm.lab.bench.stranger", *args], stdout=log, stderr=log
    )
    log.close()
    return proc, row


def collect(spawned: Any) -> dict[str, Any]:
    """Stop a stranger :func:`spawn` started (a file it polls for: a signal could land before
    its imports are done); what it did."""
    proc, row = spawned
    _stop_file(row).touch()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        return json.loads(row.read_text())
    except (OSError, ValueError):
        return {"note": f"the stranger left no row (exit {proc.returncode})"}


def main(argv: list[str]) -> None:
    """``python -m lowcomm.lab.bench.stranger KIND OUT SITE DELAY_S SECONDS CAPTURED ROW
    [LIGHTHOUSE]``: act until ROW.stop appears (or the run's limit), then write the row."""
    kind, out, site, delay, seconds, captured, row, *lighthouse = argv
    stranger = Stranger(
        kind, Path(out), int(site), float(delay), float(seconds), Path(captured), *lighthouse
    )
    stranger.start()
    stop, until = _stop_file(Path(row)), time.monotonic() + 900
    while not stop.exists() and time.monotonic() < until:
        time.sleep(0.1)
    Path(row).write_text(json.dumps(stranger.finish()) + "\n")


def _stop_file(row: Path) -> Path:
    return row.with_suffix(".stop")


if __name__ == "__main__":
    main(sys.argv[1:])
