"""An authenticating front for torchft's lighthouse: the address the sites of a keyed run ask,
which forwards to the lighthouse (listening on loopback only) just the quorum requests that
carry a valid MAC under the run's secret and the name they were sealed with.

Why: torchft's lighthouse answers anyone. A stranger's request under a site's name displaced
that site's own (it keeps the last request per name), and a stranger's request under any name
became a participant the lighthouse counts: a quorum round then closed with whichever site
asked next and the stranger, so two members asking a moment apart landed in different quorums
(chaos seeds 5 and 12, rounds=quorum). Behind the front a stranger's request never reaches the
lighthouse: it is refused with ``PERMISSION_DENIED`` and counted. Nor does a replay: of a
name's sealed requests only ones at least as new as the last it forwarded pass, and none sent
more than ``FRESH_S`` ago (their ``seq``, the time they were sent, is sealed): a member's older
request does not come through, nor one recorded in another run (but one of the last
``FRESH_S`` seconds, under its own name: a participant the lighthouse counts, for a moment).

It speaks the lighthouse's gRPC protocol byte for byte (torchft's own ``LighthouseClient`` on
both sides): it reads the one field it needs (the requester's data, a JSON string) from the
request's protobuf bytes and forwards the bytes unchanged, with the caller's deadline. A
heartbeat names only a replica: it is forwarded for a name a valid request came in under, and
answered (not forwarded) for any other once the front has served ``REGISTER_S`` (until then
every beat goes through: the sites re-register with a restarted lighthouse by their beats
before they ask again). So a stranger's heartbeats keep no name alive that never asked with the
secret, but in that first window, and one under a member's name always can (documented).
Anything else of the service (GetConfig, SubscribeFailures) is not served.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .admission import Admission
from .messages import Request

log = logging.getLogger("lowcomm")

SERVICE = "torchft.LighthouseService"
REFUSED = "lowcomm front: refused: this request carries no valid MAC under the run's secret"
# a request sent longer ago than this (by its sealed seq, against this machine's clock) is
# stale: a recording. Wide enough for the clocks of machines kept by NTP
FRESH_S = 300.0
# after it starts, every heartbeat is forwarded for this long: the sites re-register with a
# restarted lighthouse by their beats before they ask again
REGISTER_S = 30.0
_THREADS = 64  # a quorum request waits for its quorum (each holds a thread that long)


class Front:
    """Forwards valid requests from ``bind`` (HOST:PORT; port 0: any) to the lighthouse at
    ``upstream``, under ``secret``; :meth:`start`, then :attr:`port`; :meth:`stop`."""

    def __init__(self, upstream: str, secret: bytes, bind: str) -> None:
        import grpc

        self.secret, self.refused = secret, 0
        self._channel = grpc.insecure_channel(upstream.removeprefix("http://"))
        self._calls = {
            m: self._channel.unary_unary(f"/{SERVICE}/{m}") for m in ("Quorum", "Heartbeat")
        }
        self._runs: dict[str, Admission] = {}  # run id -> its key (derived once)
        self._vouched: set[str] = set()  # names a valid request came in under
        self._newest: dict[str, int] = {}  # name -> the newest seq a valid request of it had
        self._lock = threading.Lock()
        self._started = time.monotonic()
        handlers = {
            "Quorum": grpc.unary_unary_rpc_method_handler(self._quorum),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat),
        }
        self._server = grpc.server(ThreadPoolExecutor(_THREADS))
        self._server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, handlers)]
        )
        self.port = self._server.add_insecure_port(bind)
        if not self.port:
            raise OSError(f"the lighthouse's front cannot listen on {bind}")

    def start(self) -> None:
        """Serve (in threads of its own)."""
        self._started = time.monotonic()
        self._server.start()

    def stop(self) -> None:
        """Stop serving; close the way to the lighthouse."""
        self._server.stop(grace=None)
        self._channel.close()

    def _quorum(self, request: bytes, context: Any) -> bytes:
        import grpc

        name, data = requester(request)
        if not self.valid(name, data):
            with self._lock:
                self.refused += 1
            context.abort(grpc.StatusCode.PERMISSION_DENIED, REFUSED)
        with self._lock:
            self._vouched.add(name)
        return self._calls["Quorum"](request, timeout=context.time_remaining())

    def _heartbeat(self, request: bytes, context: Any) -> bytes:
        name = _fields(request).get(1, b"").decode(errors="replace")
        with self._lock:
            known = name in self._vouched
        # just started (again): the live sites beat before they ask, so that a restarted
        # lighthouse knows them all before the first quorum (see .link); after that, only names
        # that asked with the secret. (A site's very first beat precedes its first request.)
        if not known and time.monotonic() - self._started > REGISTER_S:
            return b""
        return self._calls["Heartbeat"](request, timeout=context.time_remaining())

    def valid(self, name: str, data: str) -> bool:
        """Whether ``data`` (a requester's JSON) is a request sealed under the run's key of the
        run it names, under the name ``name`` it came in."""
        try:
            raw = json.loads(data)
        except ValueError:
            return False
        request = Request.from_wire(raw, name)
        if request is None or not request.sealed or not isinstance(request.run, str):
            return False
        with self._lock:
            admission = self._runs.get(request.run)
            if admission is None:
                admission = self._runs[request.run] = Admission(-1, request.run, self.secret)
            if not admission.valid(request.mac, "request", request.signed):
                return False
            # a name's requests come newer and newer (seq: when sent, sealed): an older one is
            # a replay (the same one again is a retry, after the lighthouse was unreachable)
            if request.seq < self._newest.get(name, 0):
                return False
            if abs(request.seq - time.time_ns()) > FRESH_S * 1e9:  # recorded long ago
                return False
            self._newest[name] = request.seq
            return True


def requester(request: bytes) -> tuple[str, str]:
    """The replica id and data of a ``LighthouseQuorumRequest``'s requester (protobuf: field
    1, a ``QuorumMember`` whose fields 1 and 7 are they); empty strings where absent."""
    member = _fields(_fields(request).get(1, b""))
    return member.get(1, b"").decode(errors="replace"), member.get(7, b"").decode(errors="replace")


def _fields(message: bytes) -> dict[int, bytes]:
    """The length-delimited fields of a protobuf ``message`` by number (the last of each);
    numbers and fixed-width fields are skipped. Malformed bytes end the reading."""
    out: dict[int, bytes] = {}
    i = 0
    while i < len(message):
        key, i = _varint(message, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            _, i = _varint(message, i)
        elif kind == 2:
            size, i = _varint(message, i)
            out[number] = message[i : i + size]
            i += size
        elif kind in (1, 5):
            i += 8 if kind == 1 else 4
        else:
            break
    return out


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while i < len(data):
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
    return value, len(data) + 1  # ran out: ends the caller's loop
