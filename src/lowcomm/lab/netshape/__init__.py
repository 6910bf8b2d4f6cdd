"""Run a training run's workers behind a link shaped by the Linux kernel.

Two topologies (docs/benchmarking.md section 2):

- ``shared``: one network namespace whose loopback is shaped with a token bucket (tbf). Every
  worker runs in it and talks over 127.0.0.1, so all traffic of all workers, in both directions,
  shares one link of the given rate. Its loopback gets a 1500 MTU (see ``mtu``).
- ``per-worker``: one namespace per worker, each joined by a veth pair to a bridge that lives in
  its own "switch" namespace. Both ends of every veth pair are shaped (worker egress = uplink,
  switch-port egress = downlink), so each worker has its own full-duplex link of the given rate:
  "M datacenters, each with an X Mbit/s link". Addresses come from ``SUBNET`` and exist only
  inside these namespaces.

Nothing is created in the host's own namespace: every interface is born inside a namespace made
here, so traffic can reach nothing but these namespaces. Deleting the namespaces deletes the
veth pairs and the bridge with them.

Usage::

    with ShapedNetwork("50mbit", "per-worker", workers=2) as net:   # checks the link on entry
        procs = [subprocess.Popen(net.command(r, [sys.executable, "train.py"]),
                                  env={**os.environ, **net.env(r)}) for r in range(2)]
        ...

Only tbf is used: netem (delay, loss), fq and cake are not available in every kernel.

Modules: ``units`` (rates, sizes, bucket depth), ``namespaces`` (ip/tc, namespace life, stale
clean-up), ``measure`` with the helper programs ``receiver.py`` and ``sender.py`` (run by path
inside the namespaces; standard library only, so no module here may shadow a standard one),
``network`` (:class:`ShapedNetwork`), ``teardown`` (signals), ``cli`` (``python -m``).
"""

from __future__ import annotations

from .errors import LinkCheckFailed, NetworkUnavailable
from .namespaces import check_prerequisites, cleanup_stale
from .network import SUBNET, ShapedNetwork, Topology
from .units import default_burst, parse_rate, parse_size

__all__ = [
    "LinkCheckFailed",
    "NetworkUnavailable",
    "ShapedNetwork",
    "SUBNET",
    "Topology",
    "check_prerequisites",
    "cleanup_stale",
    "default_burst",
    "parse_rate",
    "parse_size",
]
