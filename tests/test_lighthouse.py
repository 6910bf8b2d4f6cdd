"""The lighthouse is no single point of failure: the launcher starts it again at the same
address, the sites wait out its absence at their next quorum, and groups carry its epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowcomm.config import ConfigError
from lowcomm.elastic import membership
from lowcomm.elastic.admission import Admission
from lowcomm.elastic.decide import View
from lowcomm.elastic.membership import Elastic, Membership
from lowcomm.elastic.messages import Request
from lowcomm.elastic.reading import Reader
from lowcomm.errors import MembershipError
from lowcomm.lab.faults import Fault, parse_faults

pytest.importorskip("torchft")

LOWCOMM = [sys.executable, "-m", "lowcomm.cli", "train"]
RUN = ["--strategy", "diloco", "--workers", "3", "--model", "tiny", "--steps", "60",
       "sync_every=10", "progress=false", "eval_every=0", "batch_size=4", "seq_len=64",
       "elastic=true", "min_workers=2", "heartbeat_timeout_s=1", "timeout_s=20"]  # fmt: skip


def _bare(site: int = 0, fingerprint: str = "fp") -> Membership:
    """A Membership with no lighthouse, no store and no heartbeat: what naming and reading
    requests need."""
    m = object.__new__(Membership)
    m.elastic = Elastic(lighthouse="http://nowhere:1", site=site, sites=2)
    m.fingerprint, m._store, m._groups = fingerprint, object(), {}
    m.admission = Admission(site, "lowcomm", None)
    m.reader = Reader(m.elastic, fingerprint, m.admission, 1)
    return m


def _view(epochs: list[int], quorum_id: int = 1) -> View:
    data = [
        Request(site=s, tag="sync@10", inc="a", store="h:1", lh=e) for s, e in enumerate(epochs)
    ]
    return View(quorum_id, list(range(len(epochs))), data)


def test_group_names_differ_across_lighthouse_epochs_for_the_same_quorum_id(monkeypatch):
    """A restarted lighthouse counts quorum ids from 1 again: the same members, quorum id and
    attempt in a new epoch are a new group under a new store prefix (before the fix: the same
    prefix, and the group of the old lighthouse's quorum 1 was reused or its keys met)."""
    names: list[str] = []

    class Group:
        def abort(self) -> None:
            pass

    monkeypatch.setattr(membership.dist, "PrefixStore", lambda name, store: names.append(name))
    monkeypatch.setattr(membership, "arrive", lambda *a: None)
    monkeypatch.setattr(membership, "gloo_group", lambda *a: Group())
    m = _bare()
    first, again = m.group(_view([0, 0])), m.group(_view([1, 1]))
    assert first is not again and len(names) == 2 and names[0] != names[1], names
    # the members of one quorum name it alike: the highest epoch any of them reported
    mixed = [membership.group_name("r", _view(e), 0) for e in ([1, 0], [0, 1], [1, 1])]
    assert len(set(mixed)) == 1 and mixed[0] != membership.group_name("r", _view([0, 0]), 0)


def test_a_starting_site_with_other_settings_stops_the_run_with_one_line():
    """Starting sites' settings are checked at the lighthouse too: one of this run id with
    another fingerprint stops every site that sees it, itself too (before the fix it was only
    left out, and every site waited for it at the start for ever). Another run's is ignored."""
    mine = Request(site=0, tag="start", fp="aaa", run="lowcomm")
    odd = Request(site=1, tag="start", fp="bbb", run="lowcomm")
    other_run = Request(site=1, tag="start", fp="ccc", run="another")
    assert _bare(0, "aaa").reader._same_run([mine, other_run]) == [mine]
    with pytest.raises(MembershipError, match="site 1 of run lowcomm has other settings"):
        _bare(0, "aaa").reader._same_run([mine, odd])
    with pytest.raises(MembershipError, match="site 0 of run lowcomm has other settings"):
        _bare(1, "bbb").reader._same_run([mine, odd])


def test_the_lighthouse_fault_takes_seconds():
    assert parse_faults("lighthouse:0@30x3", 3, 60) == [Fault("lighthouse", 0, 30, 3.0)]
    for bad in ("lighthouse:0@30", "lighthouse:0x3", "lighthouse:3@30x3"):
        with pytest.raises(ConfigError):
            parse_faults(bad, 3, 60)


def _last_theta(out: Path, site: int) -> dict:
    lines = (out / "sites" / f"site{site}.syncs.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


# 11 s: by hand (-m slow); the standalone lighthouse's restart below and the fault campaign's
# lighthouse: seeds (tests/test_chaos.py, bench chaos) cover the restart by default
@pytest.mark.slow
def test_a_killed_lighthouse_is_started_again_and_every_site_finishes(tmp_path):
    """The lighthouse is SIGKILLed when site 0 reaches step 30 and is back 2 s later at the
    same address: the sites wait for it at their sync, and the run ends as if nothing
    happened (every site, all syncs, the same model). Before the fix the fault did not exist;
    killing the launcher's lighthouse stopped every site ("no quorum ... lighthouse is gone")."""
    out = tmp_path / "run"
    done = subprocess.run(
        [*LOWCOMM, *RUN, "--faults", "lighthouse:0@30x2", "--out", str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "the lighthouse is back at" in done.stdout, done.stdout[-2000:]
    assert "is gone" not in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["membership"] == []  # nobody left
    assert summary["tokens"] == 3 * 60 * 4 * 64
    last = [_last_theta(out, s) for s in range(3)]
    assert all(x == last[0] for x in last) and last[0]["syncs"] == 6, last


# 26 s: by hand (-m slow); both fault campaigns kill and restart the lighthouse in every pass
@pytest.mark.slow
def test_a_standalone_lighthouse_serves_a_run_and_survives_a_restart_at_its_address(tmp_path):
    """`lowcomm lighthouse --port P --secret-file F`: the sites of `lowcomm train ...
    lighthouse=...:P secret_file=F` meet there, behind its authenticating front; killed
    (SIGKILL) and started again by the same command while they train, the run goes on to its
    end (the sites re-register by their heartbeats); SIGTERM stops it with exit 0; the port
    taken is one line, exit 2."""
    import os
    import signal
    import time

    from lowcomm.train.ports import free_port

    port = free_port(host="")
    secret = tmp_path / "secret"
    secret.write_text("the run's secret\n")
    serve = [sys.executable, "-m", "lowcomm.cli", "lighthouse", "--port", str(port),
             "--timeout-s", "20", "--heartbeat-timeout-s", "1",
             "--secret-file", str(secret)]  # fmt: skip

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = proc.stdout.readline()
        assert "lowcomm: lighthouse at" in line and "only requests sealed" in line, line
        return proc

    lighthouse = start()
    taken = subprocess.run(serve, capture_output=True, text=True)
    assert taken.returncode == 2 and f"port {port} is in use" in taken.stderr
    out = tmp_path / "run"
    run = subprocess.Popen([*LOWCOMM, *RUN, "--steps", "120", f"lighthouse=127.0.0.1:{port}",
                            f"secret_file={secret}", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        while (
            not (out / "metrics.jsonl").exists()
            or "step" not in (out / "metrics.jsonl").read_text()
        ):
            assert run.poll() is None, run.communicate()[1][-3000:]
            time.sleep(0.2)
        os.kill(lighthouse.pid, signal.SIGKILL)  # its machine gone; then started again
        lighthouse.wait()
        time.sleep(1)
        lighthouse = start()
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["membership"] == [] and summary["inner_steps"] == 120
    finally:
        run.kill()
        lighthouse.send_signal(signal.SIGTERM)
        said, _ = lighthouse.communicate(timeout=30)
    assert lighthouse.returncode == 0 and "lowcomm: lighthouse stopped" in said
    assert "lowcomm: the front refused 0 requests" in said


@pytest.mark.parametrize("heartbeat_s", [0.05, 0.2, 1.0])
def test_a_site_back_from_an_outage_asks_only_after_every_beat_channel_reconnects(
    monkeypatch, heartbeat_s
):
    """A restarted lighthouse forms a quorum of the sites that ask once every site it has
    heard from asks: a live member whose beat channel is still in gRPC's reconnect backoff
    when the others ask is left out (chaos --ranks 2, a joiner right after the lighthouse came
    back). The channel a beat goes by must reconnect, jitter included, and send its next beat
    within the settle a site waits before it asks."""
    import grpc

    from lowcomm.elastic import link

    seen: dict[str, int] = {}

    def channel(target, options):
        seen.update(dict(options))
        raise RuntimeError("no channel here")

    monkeypatch.setattr(grpc, "insecure_channel", channel)
    monkeypatch.setattr(link, "_channels", {})
    with pytest.raises(RuntimeError, match="no channel here"):
        link._call("127.0.0.1:1", link.BEAT, b"", 0.1)
    worst_s = 1.2 * seen["grpc.max_reconnect_backoff_ms"] / 1000  # gRPC's jitter is 20 %
    assert worst_s + 2 * heartbeat_s <= link.settle_s(heartbeat_s)
    assert link.settle_s(heartbeat_s) >= link.SETTLE_BEATS * heartbeat_s
