"""One launch per site: each site of an elastic run started by its own command (``site=N
sites=S lighthouse=HOST:PORT``), into its own folder, nothing shared but the lighthouse's
address; the same command brings a killed site back into the running run, where it heals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

LOWCOMM = [sys.executable, "-m", "lowcomm.cli"]
# steps of the default batch: the two sites left take longer than a site takes to start again
SITE = ["train", "--strategy", "diloco", "--model", "tiny", "--steps", "240", "sync_every=10",
        "progress=false", "eval_every=0", "threads=1", "elastic=true", "min_workers=2",
        "heartbeat_timeout_s=1", "timeout_s=20", "sites=3"]  # fmt: skip


def _lighthouse(secret: Path | None = None) -> tuple[subprocess.Popen, int]:
    """`lowcomm lighthouse` (keyed with ``secret``: sites with a secret refuse an open one)."""
    from lowcomm.train.ports import free_port

    port = free_port(host="")
    keyed = ["--secret-file", str(secret)] if secret is not None else []
    proc = subprocess.Popen(
        [*LOWCOMM, "lighthouse", "--port", str(port), "--timeout-s", "20",
         "--heartbeat-timeout-s", "1", *keyed],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert "lowcomm: lighthouse at" in proc.stdout.readline()
    return proc, port


def _site(i: int, port: int, out: Path) -> subprocess.Popen:
    command = [*LOWCOMM, *SITE, f"site={i}", f"lighthouse=127.0.0.1:{port}", "--out", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _syncs(out: Path, site: int) -> int:
    path = out / "sites" / f"site{site}.syncs.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


# about 30 s alone on 2 cores (three sites of the default batch, one started twice): by hand
# (-m slow) until the default suite has room; the refusals below run by default
@pytest.mark.slow
def test_sites_launched_on_their_own_train_and_a_killed_one_comes_back_by_the_same_command(
    tmp_path,
):
    """Three sites, three commands, three folders. Site 2 is SIGKILLed after its third sync
    and started again by the same command into the same folder: the other two go on without
    it, it joins the running run and heals, and all three end with the same parameters; its
    metrics keep what it logged before it died. A fourth start into a finished folder is
    refused with one line."""
    lighthouse, port = _lighthouse()
    outs = [tmp_path / f"site{i}" for i in range(3)]
    try:
        procs = [_site(i, port, outs[i]) for i in range(3)]
        while _syncs(outs[2], 2) < 3:
            assert procs[2].poll() is None, procs[2].communicate()[1][-3000:]
            time.sleep(0.1)
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        before = (
            (outs[2] / "metrics.jsonl").read_text() if (outs[2] / "metrics.jsonl").exists() else ""
        )
        procs[2] = _site(2, port, outs[2])
        said = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in said]
    finally:
        for p in procs:
            p.kill()
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.communicate(timeout=30)
    models = [torch.load(o / "model.pt", weights_only=False) for o in outs]
    for m in models[1:]:
        assert m.keys() == models[0].keys()
        assert all(torch.equal(m[k], models[0][k]) for k in m if torch.is_tensor(m[k]))
    events = [json.loads(x) for x in (outs[0] / "membership.jsonl").read_text().splitlines()]
    assert [e.get("left") for e in events][0] == [2] and events[-1].get("joined") == [2], events
    assert "joined" in said[2][0] + said[2][1]
    after = (outs[2] / "metrics.jsonl").read_text()
    assert after.startswith(before)  # what it logged before it died is kept
    again = subprocess.run([*LOWCOMM, *SITE, "site=0", f"lighthouse=127.0.0.1:{port}", "--out",
                            str(outs[0])], capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 2 and "holds a finished run" in again.stderr, again.stderr[-500:]


def _refused(capsys, args: list[str], says: str) -> None:
    """``lowcomm ARGS`` in this process (conftest's ``no_start``; test_cli runs the real
    command's exit status once): exit 2, one line naming ``says``."""
    from lowcomm import cli

    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2 and says in err, err[-1000:]
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "extra, says",
    [(["site=0", "elastic=false"], "add elastic=true"),
     (["site=0"], "lighthouse=HOST:P"),
     (["site=3", "lighthouse=127.0.0.1:1"], "must be in [0, sites=3)"),
     (["site=0", "lighthouse=127.0.0.1:1", "--workers", "3"], "drop --workers")],
)  # fmt: skip
def test_a_site_launched_on_its_own_without_what_it_needs_is_refused_with_one_line(
    tmp_path, capsys, no_start, extra, says
):
    _refused(capsys, [*SITE, *extra, "--out", str(tmp_path / "x")], says)


def test_a_replay_refuses_to_bring_back_a_site_that_never_came_back_with_one_line(
    tmp_path, capsys, no_start
):
    """--replay with site=: a folder holding this site's unfinished run means its command is
    run again, which the recorded run must show (here only site 1 left and came back)."""
    record = tmp_path / "membership.jsonl"
    record.write_text(
        json.dumps({"at": "sync@30", "after": "sync@20", "last_step": 20, "left": [1],
                    "members": [0, 2], "resync_s": 0.1}) + "\n"
        + json.dumps({"at": "sync@60", "after": "sync@50", "last_step": 50, "left": [],
                      "members": [0, 1, 2], "resync_s": 0.1, "joined": [1]}) + "\n"
    )  # fmt: skip
    out = tmp_path / "site0"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # this site's unfinished run
    args = [*SITE, "site=0", "lighthouse=127.0.0.1:1", "--replay", str(record), "--out", str(out)]
    _refused(capsys, args, "site 0 did not come back in the recorded run")


def _stranger(port: int, stop: threading.Event, claims: str) -> None:
    """A process without the secret: it asks the lighthouse again and again as a site of the
    run (``claims``: the run id it claims), with junk for a MAC, until ``stop``."""
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    client = LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=timedelta(seconds=5))
    junk = {"site": 9, "tag": "start", "phase": "sync", "gen": 0, "join_from": 0, "enter": True,
            "run": claims, "fp": "x", "mac": "00" * 32}  # fmt: skip
    while not stop.is_set():
        try:
            client.quorum(replica_id=f"{claims}/site0009", timeout=timedelta(seconds=1),
                          address="", store_address="", step=0, world_size=1,
                          shrink_only=False, data=junk)  # fmt: skip
        except Exception:  # no quorum within its second: ask again
            pass


def test_two_sites_launched_on_their_own_train_to_the_same_model(tmp_path, monkeypatch):
    """The default suite's case of one launch per site (one rank each, no fault): two
    commands, two folders, the keyed lighthouse between them, a run secret; both end with the
    same parameters and write their own summary, and keep the run id in their folders. A
    stranger asking as a site of the run with a bad MAC from before the start to the end
    decides nothing: the lighthouse's front refuses it, and no site ever reads it. (Behind an
    open lighthouse the sites ignored its requests: test_admission's
    test_a_strangers_junk_stops_no_site_at_the_start pins that reading.)"""
    secret = tmp_path / "secret"
    secret.write_text("the run's secret\n")
    lighthouse, port = _lighthouse(secret)
    outs = [tmp_path / f"site{i}" for i in range(2)]
    short = [a if a != "240" else "30" for a in SITE if a != "sites=3"] + ["sites=2"]
    monkeypatch.delenv("LOWCOMM_SECRET", raising=False)
    claims = "trial-run"  # the run id the stranger read somewhere (a quorum, a log)
    stop = threading.Event()
    stranger = threading.Thread(target=_stranger, args=(port, stop, claims), daemon=True)
    stranger.start()
    time.sleep(1.0)  # its junk is at the lighthouse before the sites ask
    try:
        keyed = [f"secret_file={secret}", f"run_id={claims}"]
        procs = [subprocess.Popen([*LOWCOMM, *short, *keyed, f"site={i}",
                                   f"lighthouse=127.0.0.1:{port}", "--out", str(outs[i])],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]  # fmt: skip
        said = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in said]
    finally:
        stop.set()
        for p in procs:
            p.kill()
        lighthouse.send_signal(signal.SIGTERM)
        told, _ = lighthouse.communicate(timeout=30)
    a, b = (torch.load(o / "model.pt", weights_only=True) for o in outs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all((o / "summary.json").exists() for o in outs)
    assert [(o / "run_id").read_text().strip() for o in outs] == [claims, claims]
    ignored = [json.loads((o / "summary.json").read_text())["ignored_messages"]
               for o in outs]  # fmt: skip
    assert ignored == [0, 0]
    refused = int(told.split("the front refused ")[1].split()[0])
    assert refused > 0, told
