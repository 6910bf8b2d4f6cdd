"""Tests of the kernel-shaped network harness (lowcomm.lab.netshape).

Tests marked ``network`` need root and iproute2; they skip, saying why, elsewhere. Run them all
with ``pytest tests/test_netshape.py -m "network or not network"``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lowcomm.lab.netshape import (
    LinkCheckFailed,
    NetworkUnavailable,
    ShapedNetwork,
    check_prerequisites,
    cleanup_stale,
    default_burst,
    parse_rate,
    parse_size,
)

# A prefix of our own, so these tests never touch namespaces of real runs.
PREFIX = "lctest"


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [
        line.split()[0]
        for line in out.splitlines()
        if line.strip() and line.startswith(f"{PREFIX}-")
    ]


@pytest.fixture(scope="module")
def network_ok() -> None:
    try:
        check_prerequisites()
    except NetworkUnavailable as e:
        print(f"skipping network tests: {e}", file=sys.stderr)
        pytest.skip(f"shaped networks unavailable: {e}")


@pytest.fixture
def net_env(network_ok: None):
    """Each network test starts and must end with none of our namespaces."""
    cleanup_stale(PREFIX)
    before = _ours()
    yield
    leftover = [ns for ns in _ours() if ns not in before]
    cleanup_stale(PREFIX, include_live=True)
    assert leftover == [], f"namespaces left behind: {leftover}"


# ---- parsing (no root needed) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bits",
    [
        ("10mbit", 10_000_000),
        ("1gbit", 1_000_000_000),
        ("500kbit", 500_000),
        ("200Mbit", 200_000_000),
        ("1.5gbit", 1_500_000_000),
        (" 64KBIT ", 64_000),
        ("1mibit", 1_048_576),
        ("2500", 2500),
        ("1tbit", 10**12),
    ],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize(
    "text",
    [
        "",
        "mbit",
        "10 megabits",
        "-5mbit",
        "0mbit",
        "10mbps",
        "1e999mbit",
        "10 mbit/s",
        "fast",
        "nan",
    ],
)
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_parse_rate_explains_bytes_units() -> None:
    with pytest.raises(ValueError, match="bytes per second"):
        parse_rate("100mbps")


def test_parse_size() -> None:
    assert parse_size("64kb") == 65536
    assert parse_size("1mb") == 2**20
    assert parse_size("1500") == 1500
    assert parse_size(4096) == 4096
    for bad in ("", "64kbit", "-1kb", 0, "x"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_default_burst() -> None:
    assert default_burst(parse_rate("1gbit"), 1500) == 500_000  # 4 ms at the rate
    assert default_burst(parse_rate("10mbit"), 1500) == 32 * 1024  # floor
    assert default_burst(parse_rate("10mbit"), 65536) >= 65536 + 14  # a whole loopback frame


# ---- configuration and naming (no root needed) -----------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rate="fast"), "rate"),
        (dict(rate="50mbit", topology="ring"), "topology"),
        (dict(rate="50mbit", workers=0), "workers"),
        (dict(rate="50mbit", topology="per-worker", workers=300), "at most"),
        (dict(rate="50mbit", burst="1kb"), "smaller than one frame"),
        (dict(rate="50mbit", topology="per-worker", mtu=65536), "mtu"),
        (dict(rate="50mbit", name_prefix="a-b"), "name_prefix"),
        (dict(rate="50mbit", tolerance=0), "tolerance"),
    ],
)
def test_impossible_config_raises_before_touching_anything(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShapedNetwork(**kwargs)


def test_names_commands_and_env() -> None:
    net = ShapedNetwork("50mbit", "per-worker", workers=3, name_prefix=PREFIX)
    names = [net.namespace(r) for r in range(3)]
    assert len(set(names)) == 3
    assert all(n.startswith(f"{PREFIX}-{os.getpid()}-") for n in names)
    assert net.command(2, ["python", "-c", "pass"]) == [
        "ip",
        "netns",
        "exec",
        names[2],
        "python",
        "-c",
        "pass",
    ]
    assert net.master_addr == net.address(0) == "10.213.0.1"
    env = net.env(1)
    assert env["MASTER_ADDR"] == "10.213.0.1" and env["RANK"] == "1"
    assert env["WORLD_SIZE"] == "3" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["LOWCOMM_ADDR"] == net.address(1) == "10.213.0.2"
    with pytest.raises(ValueError):
        net.namespace(3)

    shared = ShapedNetwork("50mbit", "shared", workers=2, name_prefix=PREFIX)
    assert shared.namespace(0) == shared.namespace(1)
    assert shared.master_addr == "127.0.0.1" and shared.env(0)["GLOO_SOCKET_IFNAME"] == "lo"
    # Two networks in one process never share names.
    assert ShapedNetwork("1mbit", name_prefix=PREFIX).namespace(0) != shared.namespace(0)


def test_measure_needs_an_active_network() -> None:
    with pytest.raises(RuntimeError, match="inside"):
        ShapedNetwork("50mbit", name_prefix=PREFIX).measure()


def test_helper_programs_run_by_path_on_plain_loopback() -> None:
    """The measuring programs are real files of the installed package, runnable by path with
    the standard library alone; on an unshaped loopback every byte sent is received."""
    from lowcomm.lab.netshape import measure

    nbytes = 3 << 20
    receiver = subprocess.Popen(
        [sys.executable, str(measure.RECEIVER), "127.0.0.1", "0", "20"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = receiver.stdout.readline().strip()
        assert port.isdigit(), port
        subprocess.run(
            [sys.executable, str(measure.SENDER), "127.0.0.1", port, str(nbytes), "20"],
            check=True,
            timeout=30,
        )
        out, _ = receiver.communicate(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bytes"] == nbytes
    assert result["rate_bps"] > 0


# ---- real shaped networks --------------------------------------------------------------------


def _qdisc_sent_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(
        ["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tbf" in out, out
    return int(re.search(r"Sent (\d+) bytes", out).group(1))


@pytest.mark.network
def test_prerequisites(network_ok: None) -> None:
    check_prerequisites()  # no raise, and no probe namespace left behind
    assert not [ns for ns in _ours() if "probe" in ns]


@pytest.mark.network
def test_shared_50mbit(net_env: None) -> None:
    with ShapedNetwork("50mbit", "shared", workers=2, name_prefix=PREFIX) as net:
        assert net.namespace(0) in _ours()
        assert net.measured_mbit is not None and abs(net.measured_mbit - 50) <= 5  # entry check
        got = net.measure(seconds=1.0)
        assert 45 <= got <= 55, got
        assert _qdisc_sent_bytes(net.namespace(0), "lo") > 50e6 / 8 * 1.0
    assert _ours() == []


@pytest.mark.network
def test_per_worker_2_workers_50mbit(net_env: None) -> None:
    with ShapedNetwork("50mbit", "per-worker", workers=2, name_prefix=PREFIX) as net:
        assert set(net.namespaces) <= set(_ours()) and len(net.namespaces) == 3
        got = net.measure(0, 1, seconds=1.0)
        assert 45 <= got <= 55, got
        # Both directions are shaped: uplink on the worker's veth, downlink on the switch port.
        assert _qdisc_sent_bytes(net.namespace(0), "eth0") > 50e6 / 8
        assert _qdisc_sent_bytes(net.namespaces[-1], "p1") > 50e6 / 8
        with pytest.raises(ValueError, match="not shaped"):
            net.measure(1, 1)
    assert _ours() == []


@pytest.mark.network
def test_teardown_when_body_raises_and_leftover_workers_are_stopped(net_env: None) -> None:
    # a background job starts with SIGINT ignored, and then the network rightly leaves it alone:
    # give this test Python's usual handler so there is one to replace and restore
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _teardown_when_body_raises()
    finally:
        signal.signal(signal.SIGINT, original)


def _netns_pids(ns: str) -> str:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return out.stdout.strip()


def _teardown_when_body_raises() -> None:
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(ZeroDivisionError):
        with ShapedNetwork(
            "20mbit", "per-worker", workers=2, name_prefix=PREFIX, check=False
        ) as net:
            cmd = net.command(1, ["sleep", "60"])  # ip netns exec NS sleep 60
            sleeper = subprocess.Popen(cmd)
            # raise only once it is inside its namespace (under load, `ip netns exec` can take a
            # moment; teardown stops what the namespace holds when it runs)
            deadline = time.time() + 30
            while time.time() < deadline and not _netns_pids(cmd[3]):
                time.sleep(0.01)
            assert len(_ours()) == 3
            assert signal.getsignal(signal.SIGINT) != handler  # ours while the network is up
            _ = 1 / 0  # the body raises ZeroDivisionError inside the network
    assert _ours() == []
    assert signal.getsignal(signal.SIGINT) == handler  # restored
    assert sleeper.wait(timeout=5) != 0  # stopped, so its namespace could really go
    net.close()  # idempotent


@pytest.mark.network
def test_link_check_failure_is_clear_and_tears_down(net_env: None) -> None:
    # 1 Tbit/s is far beyond what a bulk TCP transfer reaches on this CPU.
    with pytest.raises(LinkCheckFailed, match="requested 1000000.0 Mbit/s") as info:
        with ShapedNetwork("1tbit", "shared", name_prefix=PREFIX, check_seconds=0.5):
            pass
    assert info.value.measured_mbit < 0.9 * info.value.requested_mbit
    assert _ours() == []


_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    from lowcomm.lab.netshape import ShapedNetwork
    with ShapedNetwork(
        "20mbit", sys.argv[1], workers=2, name_prefix=sys.argv[2], check=False
    ) as net:
        print(" ".join(net.namespaces), flush=True)
        time.sleep(60)
    """
)


@pytest.mark.network
@pytest.mark.parametrize(
    "sig, topology", [(signal.SIGINT, "per-worker"), (signal.SIGTERM, "shared")]
)
def test_signal_in_body_tears_down(net_env: None, sig: int, topology: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL_SCRIPT, topology, PREFIX],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        names = proc.stdout.readline().split()
        assert names, proc.stderr.read()
        assert set(names) <= set(_ours())
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:
        # An uncaught KeyboardInterrupt ends Python by SIGINT (-2) since 3.8.
        assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err, err
    else:
        assert proc.returncode == -signal.SIGTERM, err  # died of the signal, as without us
    assert not set(names) & set(_ours())


@pytest.mark.network
def test_cleanup_stale(net_env: None) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{PREFIX}-{dead.pid}-0-w0", f"{PREFIX}-{os.getpid()}-99-w0"
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert cleanup_stale(PREFIX) == [stale]
        assert _ours() == [live]
    finally:
        cleanup_stale(PREFIX, include_live=True)


_ALL_REDUCE = textwrap.dedent(
    """
    import datetime, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.full((262144,), float(dist.get_rank() + 1))  # 1 MiB
    dist.all_reduce(t)
    assert torch.all(t == 3.0), t[:4]
    print("ok", dist.get_rank(), flush=True)
    dist.destroy_process_group()
    """
)


def _all_reduce_through(net: ShapedNetwork) -> None:
    procs = []
    for rank in range(2):
        env = {**os.environ, **net.env(rank), "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(
                net.command(rank, [sys.executable, "-c", _ALL_REDUCE]),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and f"ok {rank}" in out, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.network
def test_gloo_all_reduce_shared(net_env: None) -> None:
    with ShapedNetwork("100mbit", "shared", workers=2, name_prefix=PREFIX, check=False) as net:
        _all_reduce_through(net)
        # The tensors crossed the shaped loopback (1 MiB each way at least).
        assert _qdisc_sent_bytes(net.namespace(0), "lo") > 2 * 2**20
    assert _ours() == []


@pytest.mark.network
def test_gloo_all_reduce_per_worker(net_env: None) -> None:
    with ShapedNetwork("100mbit", "per-worker", workers=2, name_prefix=PREFIX, check=False) as net:
        assert net.env(1)["MASTER_ADDR"] == net.address(0)
        _all_reduce_through(net)
        for rank in range(2):  # each worker's uplink carried its half of the exchange
            assert _qdisc_sent_bytes(net.namespace(rank), "eth0") > 2**20 / 2
    assert _ours() == []


@pytest.mark.network
def test_cli(network_ok: None) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowcomm.lab.netshape",
            "--rate",
            "30mbit",
            "--topology",
            "per-worker",
            "--workers",
            "2",
            "--no-check",
            "--seconds",
            "0.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    import json

    report = json.loads(done.stdout)
    # shaped, not timed: 0.5 s of a token bucket reads its burst too (33.8 once under load,
    # against loopback's Gbit/s), so the check is that the link runs near its rate, not at it
    assert 15 <= report["measured_mbit"][0] <= 45
    assert not set(report["namespaces"]) & set(
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    )
    bad = subprocess.run(
        [sys.executable, "-m", "lowcomm.lab.netshape", "--rate", "10mbps"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "bytes per second" in bad.stderr
