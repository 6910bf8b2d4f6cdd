"""An authenticating front for torchft's lighthouse: the address the sites of a keyed run ask,
which forwards to the lighthouse (listening on loopback only) just the quorum requests that
carry a valid MAC under the run's secret and the name they were sealed with.

Why: torchft's lighthouse answers anyone, and every request it holds is a participant it
counts. A stranger's request under a site's name displaced that site's own (it keeps the last
request per name), and a stranger's request under any name closed a quorum round with whichever
site asked next, so two members asking a moment apart landed in different quorums (chaos seeds
5 and 12, rounds=quorum). Behind the front such a request is refused with ``PERMISSION_DENIED``
and counted, after ``TARPIT_S``: refused at once, a flood asked again at once, and on 2 cores the
refusals took the sites' CPU (benchmarks/trust.md). At most ``_HELD`` refusals wait at once (the
rest are answered at once): a stranger asking from more threads than the front serves would
otherwise hold every thread, and the members' requests would queue behind it.

What passes: a request whose protobuf holds exactly the fields a ``LighthouseQuorumRequest``
has, each once (anything else is refused: the lighthouse would read bytes the front did not),
whose data is a request sealed under the key of the run it names (with ``run_ids``, one of
those), under the name it came in, sent (its sealed ``seq``) within ``FRESH_S`` of this
machine's clock and no earlier than the newest one forwarded from the same process of that
name (that one again only within ``RETRY_S``: a retry, not a recording replayed after its
round), and whose fields outside the MAC (step, world size, shrink-only, commit failures) are
as every site sends them. So a member's older request does not come through, nor one
recorded in another run more than ``FRESH_S`` ago (a launcher's front takes its own run's
only: none at all). The bytes go on
unchanged, with the caller's deadline; the lighthouse's own error comes back as it was.

A heartbeat is forwarded only when it carries a seal (a field the lighthouse never reads: the
front strips it) under the key of a served run, for the name it came with, stamped within
``FRESH_S`` of this machine's clock and later than the last one forwarded from the same process
of that name. So a stranger's beats, under a dead or paused site's name, never reach the
lighthouse (it keeps every name it hears a beat from, and waits for each one it keeps); a beat
recorded and replayed is older than its process's last. Nothing else of torchft's service is
served. ``lowcomm.Front/Prove`` answers a site's nonce with a MAC under its run's key: a keyed
site asks it first, and an open lighthouse, which does not know the method, is refused before
the site starts (a stranger there could take a member's name).

``lowcomm.Front/End``: a site that finished the run says so, sealed. From then on the
processes of that run that were away from it when the word came are refused with the line
``ENDED`` names: those whose requests came through before and whose beats had lapsed (none for
``lapse_s``, the lighthouse's own heartbeat timeout: it had left them out too) or whose last
request was a joiner's (never let back in: a lone joiner at a lighthouse whose join wait is
long would wait on unbounded), and the one that said it. Why: sites left out together
(paused, cut off) that come back after the others finished find only each other at the
lighthouse, which has no memory of a run, and would train on as the run (chaos seed 103). Why
not every process that asked: an insider (a member holding the secret, its code changed) could
then say it mid-run and stop every honest site; a process beating at the front when the word
comes is alive, whoever says otherwise, and a beat cannot be taken back (an insider can still
stop a joiner asking at that moment). A process that never asked before (a later run under
the same id, a site started again) is not refused; each process ends a run once (a recording
of its word, sent again, ends nothing more).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .admission import Admission
from .messages import Beat, End, Request, proof_request

SERVICE = "torchft.LighthouseService"
PROOF = "/lowcomm.Front/Prove"  # a keyed front's own methods (see the module)
END = "/lowcomm.Front/End"
ENDED = "lowcomm front: the run is over"
REFUSED = "lowcomm front: refused: this request carries no valid MAC under the run's secret"
STALE = "lowcomm front: refused: a stale or replayed request"
OTHER_RUN = "lowcomm front: refused: another run's request"
RETRY_S = 2.0  # a request's own seq is taken again this long after it first came (a retry)
# a QuorumMember's fields the MAC does not cover, as every site sends them (absent: 0): step,
# world_size, shrink_only, commit_failures (torchft reads them when it forms a quorum)
_AS_SENT = {4: 0, 5: 1, 6: 0, 8: 0}


def other_run(run: str, served: str) -> str:
    """The refusal of a valid request of run ``run`` by a front serving run ``served`` only."""
    return f"{OTHER_RUN} (run {run}; this lighthouse serves {served})"


def served_run(details: str) -> str | None:
    """The run a front serves, read from its :func:`other_run` refusal (None: not one)."""
    if OTHER_RUN not in details:
        return None
    return details.split("this lighthouse serves ", 1)[-1].split(")", 1)[0]


# a request sent longer ago than this (by its sealed seq, against this machine's clock) is a
# recording; each send is sealed anew (see .link), so only clocks apart by more refuse a site
FRESH_S = 300.0
TARPIT_S = 0.5  # a refusal's delay (see Front._quorum)
_THREADS = 256  # each quorum request holds a thread while its quorum forms
_HELD = 64  # refusals held at once: past these, refused at once (threads stay for the sites)
_MAX_BYTES = 1 << 16  # a quorum request is a few hundred bytes
_RUNS = 64  # run ids whose keys are kept (derived again when dropped)
# a QuorumMember's fields: number -> protobuf wire type (0: varint, 2: bytes)
_MEMBER = {1: 2, 2: 2, 3: 2, 4: 0, 5: 0, 6: 0, 7: 2, 8: 0}


class Front:
    """Forwards valid requests from ``bind`` (HOST:PORT; port 0: any) to the lighthouse at
    ``upstream``, under ``secret`` (``run_ids``: only these runs'); :meth:`start`, then
    :attr:`port`; :meth:`stop`. ``refused``: quorum requests refused; ``dropped``: beats.
    ``lapse_s``: the lighthouse's heartbeat timeout (a process silent this long is away)."""

    def __init__(
        self,
        upstream: str,
        secret: bytes,
        bind: str,
        run_ids: frozenset[str] | None = None,
        lapse_s: float = 2.0,
    ) -> None:
        import grpc

        self.secret, self.run_ids, self.lapse_s = secret, run_ids, lapse_s
        self.refused = self.dropped = 0
        self._channel = grpc.insecure_channel(upstream.removeprefix("http://"))
        self._calls = {
            m: self._channel.unary_unary(f"/{SERVICE}/{m}") for m in ("Quorum", "Heartbeat")
        }
        self._runs: dict[str, Admission] = {}  # run id -> its key (derived once)
        # (name, process) -> its newest seq, and when that one first came
        self._newest: dict[tuple[str, str], tuple[int, float]] = {}
        self._beats: dict[tuple[str, str], int] = {}  # (name, process) -> its last beat's stamp
        self._asked: dict[str, set[str]] = {}  # run -> the processes whose requests came through
        self._ended: dict[tuple[str, str], str] = {}  # (run, process) -> why it is refused
        self._enders: set[tuple[str, str]] = set()  # (run, process) that said it finished
        self._beat_at: dict[tuple[str, str], float] = {}  # (run, process) -> its last beat, here
        self._joining: set[tuple[str, str]] = set()  # (run, process) whose last request joins
        self._lock = threading.Lock()
        self._held = threading.BoundedSemaphore(_HELD)
        handlers = {
            "Quorum": grpc.unary_unary_rpc_method_handler(self._quorum),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat),
        }
        self._server = grpc.server(
            ThreadPoolExecutor(_THREADS),
            # one lighthouse per port: a second bind fails, as torchft's own does
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", _MAX_BYTES)],
        )
        own = {
            "Prove": grpc.unary_unary_rpc_method_handler(self._prove),
            "End": grpc.unary_unary_rpc_method_handler(self._end),
        }
        self._server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(SERVICE, handlers),
                grpc.method_handlers_generic_handler(PROOF.split("/")[1], own),
            ]
        )
        try:  # (grpcio raises where it cannot bind; older ones returned 0)
            self.port = self._server.add_insecure_port(bind)
        except RuntimeError as err:
            raise OSError(f"the lighthouse's front cannot listen on {bind}: {err}") from None
        if not self.port:
            raise OSError(f"the lighthouse's front cannot listen on {bind}")

    def start(self) -> None:
        """Serve (in threads of its own)."""
        self._server.start()

    def stop(self) -> None:
        """Stop serving; close the way to the lighthouse."""
        self._server.stop(grace=None)
        self._channel.close()

    def _quorum(self, request: bytes, context: Any) -> bytes:
        import grpc

        why = self.refusal(request)
        if why.startswith(ENDED):  # a site of the run, back after it ended: told at once
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        if why:
            with self._lock:
                self.refused += 1
            # held a moment before the answer: a flood then asks at the pace its threads wait,
            # not as fast as the CPU refuses (which took the sites' cores on a small host); at
            # most _HELD at once, so a flood of more threads never holds the members' threads
            if self._held.acquire(blocking=False):
                try:
                    time.sleep(min(TARPIT_S, max(0.0, (context.time_remaining() or 0.0) - 0.05)))
                finally:
                    self._held.release()
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        return self._forward("Quorum", request, context)

    def _heartbeat(self, request: bytes, context: Any) -> bytes:
        import grpc

        fields = _strict(request, {1: 2, 2: 2})
        if fields is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lowcomm front: a malformed beat")
        name = bytes(fields.get(1, b""))
        if not self.beat_passes(name.decode(errors="replace"), bytes(fields.get(2, b""))):
            with self._lock:
                self.dropped += 1
            return b""  # answered as the lighthouse would: a stranger learns nothing
        return self._forward("Heartbeat", beat_request(name), context)

    def beat_passes(self, name: str, seal: bytes) -> bool:
        """Whether a beat under ``name`` with ``seal`` is forwarded (see the module): then its
        stamp is its process's newest."""
        beat = Beat.from_wire(seal)
        if beat is None or not _of_run(name, beat.run):
            return False
        if self.run_ids is not None and beat.run not in self.run_ids:
            return False
        if not self._admission(beat.run).beat_valid(name, beat):
            return False
        if abs(beat.seq - time.time_ns()) > FRESH_S * 1e9:
            return False
        with self._lock:
            if beat.seq <= self._beats.get((name, beat.inc), 0):
                return False  # a recording, replayed
            self._beats[(name, beat.inc)] = beat.seq
            self._beat_at[(beat.run, beat.inc)] = time.monotonic()
        return True

    def _prove(self, request: bytes, context: Any) -> bytes:
        """A site's proof request (run, nonce): the MAC of the nonce under the run's key
        (another run's, on a front serving some only: refused, naming the run served)."""
        import grpc

        asked = proof_request(request)
        if asked is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lowcomm front: a malformed proof")
        run, nonce = asked
        if self.run_ids is not None and run not in self.run_ids:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, other_run(run, min(self.run_ids)))
        return self._admission(run).proof(nonce).encode()

    def _end(self, request: bytes, context: Any) -> bytes:
        """A site's sealed word that it finished the run: the processes of that run away from
        it now (see the module) are refused from then on."""
        import grpc

        end = End.from_wire(request)
        if end is None or (self.run_ids is not None and end.run not in self.run_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lowcomm front: a malformed end")
        assert end is not None  # (abort raises)
        if not self._admission(end.run).end_valid(end):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, REFUSED)
        if abs(end.seq - time.time_ns()) > FRESH_S * 1e9:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, STALE)
        line = f"{ENDED}: site {end.site} finished run {end.run} after {end.tag}"
        with self._lock:
            who = (end.run, end.inc)
            if who in self._enders or end.inc not in self._asked.get(end.run, ()):
                return b""  # said again (a recording), or a process that never asked: nothing
            self._enders.add(who)
            self._ended.setdefault(who, line)
            lapsed = time.monotonic() - self.lapse_s
            for inc in self._asked[end.run]:
                process = (end.run, inc)
                if process in self._joining or self._beat_at.get(process, 0.0) < lapsed:
                    self._ended.setdefault(process, line)
        return b""

    def _forward(self, method: str, request: bytes, context: Any) -> bytes:
        """``request`` to the lighthouse with the caller's deadline, cancelled if the caller
        goes; the lighthouse's error relayed as it was."""
        import grpc

        call = self._calls[method].future(request, timeout=context.time_remaining())
        context.add_callback(call.cancel)
        try:
            return call.result()  # type: ignore[no-any-return]
        except grpc.RpcError as err:
            context.abort(err.code(), err.details() or "")
            raise  # (abort raises)

    def refusal(self, request: bytes) -> str:
        """Why ``request`` (a ``LighthouseQuorumRequest``'s bytes) is refused; '' if it
        passes."""
        member = _requester(request)
        if member is None:
            return REFUSED
        if any(member.get(f, 0) != v for f, v in _AS_SENT.items()):
            return REFUSED  # fields the MAC does not cover, not as a site sends them
        name = bytes(member.get(1, b"")).decode(errors="replace")
        try:
            raw = json.loads(bytes(member.get(7, b"")).decode(errors="replace"))
        except (ValueError, RecursionError):
            return REFUSED
        request_ = Request.from_wire(raw, name) if isinstance(raw, dict) else None
        if request_ is None or not request_.sealed or not isinstance(request_.run, str):
            return REFUSED
        if not self._admission(request_.run).valid(request_.mac, "request", request_.signed):
            return REFUSED
        if abs(request_.seq - time.time_ns()) > FRESH_S * 1e9:
            return f"{STALE}: sent more than {FRESH_S:g} s from the lighthouse's clock"
        if self.run_ids is not None and request_.run not in self.run_ids:
            # sealed under the secret, recent: a site of another run, told the run served here
            return other_run(request_.run, min(self.run_ids))
        return self._fresh(name, request_)

    def _fresh(self, name: str, request: Request) -> str:
        """'' if ``request`` (valid) is recent and no older than its process's last; else
        why not."""
        now = time.monotonic()
        with self._lock:
            ended = self._ended.get((str(request.run), request.inc))
            if ended is not None:
                return ended
            self._asked.setdefault(str(request.run), set()).add(request.inc)
            process = (str(request.run), request.inc)
            (self._joining.add if request.join else self._joining.discard)(process)
            who = (name, request.inc)
            seq, first = self._newest.get(who, (0, now))
            # each send is stamped anew: the same seq again is the transport's retry, for a
            # moment, or a recording replayed after its round
            if request.seq < seq or (request.seq == seq and now - first > RETRY_S):
                return f"{STALE}: older than its site's last"
            if request.seq > seq:
                self._newest[who] = (request.seq, now)
        return ""

    def _admission(self, run_id: str) -> Admission:
        with self._lock:
            admission = self._runs.get(run_id)
            if admission is None:
                if len(self._runs) >= _RUNS:  # junk naming a new run each time: bounded
                    self._runs.clear()
                admission = self._runs[run_id] = Admission(-1, run_id, self.secret)
            return admission


def _of_run(name: str, run: str) -> bool:
    """Whether ``name`` is one a site of ``run`` carries (``RUN/siteNNNN``, or a fresh one
    after it: see .reading)."""
    head = name.removeprefix(run + "/").partition("/")[0]
    return name.startswith(run + "/site") and head[4:].isdigit() and len(head) <= 10


def beat_request(name: bytes, seal: bytes = b"") -> bytes:
    """A ``LighthouseHeartbeatRequest`` for ``name`` (field 1), with ``seal`` as field 2 (a
    field torchft's lighthouse skips; a keyed front checks and strips it)."""
    out = b"\x0a" + _varint_bytes(len(name)) + name
    return out + (b"\x12" + _varint_bytes(len(seal)) + seal if seal else b"")


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _requester(request: bytes) -> dict[int, Any] | None:
    """The fields of a ``LighthouseQuorumRequest``'s requester (a ``QuorumMember``), read
    strictly; None when the bytes hold anything else (see :func:`_strict`)."""
    top = _strict(request, {1: 2})
    if top is None or 1 not in top:
        return None
    return _strict(top[1], _MEMBER)


def _strict(message: bytes, allowed: dict[int, int]) -> dict[int, Any] | None:
    """The fields of protobuf ``message`` (number -> bytes or int), when it holds only fields
    of ``allowed`` (number -> wire type), each at most once; None otherwise (a field it does not
    know, a group, a repeat, bytes cut short): the lighthouse must read nothing the front did
    not, and a decoder merges repeats and skips unknown fields."""
    if len(message) > _MAX_BYTES:
        return None
    out: dict[int, Any] = {}
    i = 0
    while i < len(message):
        key, i = _varint(message, i)
        if key is None or allowed.get(key >> 3) != key & 7 or key >> 3 in out:
            return None
        if key & 7 == 0:
            value, i = _varint(message, i)
            if value is None:
                return None
            out[key >> 3] = value
            continue
        size, i = _varint(message, i)
        if size is None or i + size > len(message):
            return None
        out[key >> 3] = message[i : i + size]
        i += size
    return out


def _varint(data: bytes, i: int) -> tuple[int | None, int]:
    """The varint at ``data[i:]`` and where it ends; None past 10 bytes or the end."""
    value = 0
    for n in range(10):
        if i + n >= len(data):
            return None, i
        byte = data[i + n]
        value |= (byte & 0x7F) << (7 * n)
        if not byte & 0x80:
            return value, i + n + 1
    return None, i
