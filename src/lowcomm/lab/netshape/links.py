"""Building a shaped network: namespaces, the bridge, veth pairs and their tbf qdiscs.

:class:`LinkBuilder` runs the ``ip`` and ``tc`` commands that make the links of one
:class:`~lowcomm.lab.netshape.network.ShapedNetwork`. Every interface is created inside a
namespace made here, never in the host's; each namespace is reported to the network (which
tears them down) before it exists.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from .errors import NetworkUnavailable
from .namespaces import CommandFailed, run
from .units import LO_MTU, TBF_LATENCY

#: Interface name of every worker's uplink in the per-worker topology (same for all ranks, so
#: ``GLOO_SOCKET_IFNAME`` is the same everywhere).
WORKER_IFNAME = "eth0"
#: The bridge's own address inside the switch namespace (a measuring endpoint for 1 worker).
SWITCH_HOST = 254
#: Private /24 whose addresses are assigned only to interfaces inside namespaces made here.
SUBNET = "10.213.0"


class LinkBuilder:
    """Creates the namespaces and shaped links of one network at ``rate_bps`` (tbf with a bucket
    of ``burst_bytes``, devices of ``mtu``).

    ``record(ns)`` is called before namespace ``ns`` is created (teardown removes what it was
    told of); ``torn()`` says the network was torn down meanwhile (a signal): nothing more is
    created then.
    """

    def __init__(
        self,
        rate_bps: int,
        burst_bytes: int,
        mtu: int,
        record: Callable[[str], None],
        torn: Callable[[], bool],
    ) -> None:
        self.rate_bps = rate_bps
        self.burst_bytes = burst_bytes
        self.mtu = mtu
        self._record = record
        self._torn = torn

    def _ip(self, *args: str) -> None:
        if self._torn():  # a signal tore us down while setting up: create nothing more
            raise RuntimeError("ShapedNetwork was torn down during set-up")
        try:
            run(list(args))
        except CommandFailed as e:
            raise NetworkUnavailable(
                f"setting up the shaped network failed: {e}. Is this a kernel with namespaces, "
                "veth, bridge and sch_tbf? check_prerequisites() tells what is missing"
            ) from e

    def _add_namespace(self, ns: str) -> None:
        self._record(ns)  # before creating: a signal in between still removes it
        self._ip("ip", "netns", "add", ns)
        self._ip("ip", "-n", ns, "link", "set", "lo", "up")

    def _tbf(self, ns: str, dev: str) -> None:
        self._ip(
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{self.rate_bps}bit",
            "burst",
            str(self.burst_bytes),
            "latency",
            TBF_LATENCY,
        )

    def shared(self, ns: str) -> None:
        """One namespace whose loopback is shaped (every rank runs in it)."""
        self._add_namespace(ns)
        if self.mtu != LO_MTU:
            self._ip("ip", "-n", ns, "link", "set", "lo", "mtu", str(self.mtu))
        self._tbf(ns, "lo")

    def per_worker(self, sw: str, workers: list[tuple[str, str]]) -> None:
        """A switch namespace ``sw`` with a bridge, and one namespace per worker, given as
        (namespace, address), each on its own veth shaped both ways."""
        self._add_namespace(sw)
        self._ip("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        self._ip("ip", "-n", sw, "addr", "add", f"{SUBNET}.{SWITCH_HOST}/24", "dev", "br0")
        self._ip("ip", "-n", sw, "link", "set", "br0", "up")
        for rank, (ns, address) in enumerate(workers):
            self._add_worker(rank, ns, address, sw)

    def _add_worker(self, rank: int, ns: str, address: str, sw: str) -> None:
        """Namespace ``ns`` for ``rank``, linked to the switch ``sw`` and shaped both ways."""
        port = f"p{rank}"
        self._add_namespace(ns)
        # Silence IPv6 (router solicitations, DAD) on the shaped links; best effort.
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-q",
                "-w",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            capture_output=True,
        )
        # Created inside the switch namespace with its peer moved straight into the
        # worker's: no interface ever exists in the host's namespace.
        self._ip(
            "ip",
            "-n",
            sw,
            "link",
            "add",
            port,
            "mtu",
            str(self.mtu),
            "type",
            "veth",
            "peer",
            "name",
            WORKER_IFNAME,
            "mtu",
            str(self.mtu),
            "netns",
            ns,
        )
        self._ip("ip", "-n", sw, "link", "set", port, "master", "br0")
        self._ip("ip", "-n", sw, "link", "set", port, "up")
        self._ip("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", WORKER_IFNAME)
        self._ip("ip", "-n", ns, "link", "set", WORKER_IFNAME, "up")
        self._tbf(ns, WORKER_IFNAME)  # uplink: worker -> switch
        self._tbf(sw, port)  # downlink: switch -> worker
