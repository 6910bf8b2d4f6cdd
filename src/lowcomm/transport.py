"""Moves bytes between workers over torch.distributed, and counts every byte it moves.

Transport never does math on what it carries (docs/design.md): it hands tensors to collectives and
meters their sizes. Byte counts come from the tensors actually given to the collective, and the
wire cost of each collective is the standard ring cost:

- all-reduce: 2(M-1)/M of the buffer, sent and received;
- all-gather: (M-1)/M of the gathered total, i.e. (M-1) x this worker's chunk;
- all-to-all: (M-1)/M of this worker's input;
- broadcast: the buffer once per receiver along a ring, i.e. (M-1)/M of it per worker on average.

"Payload" bytes are what this worker contributed (the input buffer). Traffic flagged
``control=True`` (start-up broadcasts, replica checks, loss logging) is counted apart.

Asynchronous work runs on one communication thread per transport, so every worker issues its
collectives in the same order (a mismatched order deadlocks) while the caller keeps computing.
Gloo releases the GIL while it waits, so the compute thread really runs meanwhile.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def ring_all_reduce_bytes(nbytes: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in a ring all-reduce of ``nbytes``:
    2(M-1)/M of them."""
    return 2 * (workers - 1) / workers * nbytes


@dataclass
class ByteMeter:
    """Running totals of the bytes this worker handed to collectives (training vs control)."""

    payload_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    control_payload_bytes: int = 0
    control_sent_bytes: int = 0
    control_received_bytes: int = 0
    collectives: int = 0
    blocked_s: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def record(self, payload: int, sent: float, received: float, control: bool) -> None:
        """Add one collective's bytes: ``payload`` this worker's input, ``sent``/``received``
        wire bytes."""
        with self._lock:
            if control:
                self.control_payload_bytes += int(payload)
                self.control_sent_bytes += int(round(sent))
                self.control_received_bytes += int(round(received))
            else:
                self.payload_bytes += int(payload)
                self.sent_bytes += int(round(sent))
                self.received_bytes += int(round(received))
                self.collectives += 1

    def add_blocked(self, seconds: float) -> None:
        """Add time the compute thread spent waiting on the network."""
        with self._lock:
            self.blocked_s += seconds

    def as_dict(self) -> dict:
        """A plain-dict snapshot (for summaries, logs and checkpoints)."""
        with self._lock:
            return {k: v for k, v in asdict(self).items()}

    def load_dict(self, d: dict) -> None:
        """Continue counting from an ``as_dict()`` snapshot (a resumed run)."""
        with self._lock:
            for k, v in d.items():
                if hasattr(self, k):
                    setattr(self, k, v)


#: makes a transport: called as ``factory(group, meter)`` (see :class:`Transport`)
TransportFactory = Callable[[Any, "ByteMeter | None"], "Transport"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def device_types(backend: str) -> set[str]:
    """The device types a process group's backend moves tensors of: ``nccl`` CUDA, ``gloo``
    (and any other) the CPU, and a device-mapped one (``cpu:gloo,cuda:nccl``) each it names."""
    name = backend.lower()
    if ":" in name:
        return {part.split(":", 1)[0].strip() for part in name.split(",")}
    return {"cuda"} if name == "nccl" else {"cpu"}


class Transport:
    """Collectives over one process group, metered; async work on a single ordered comm thread.

    The engine makes every transport between workers through a factory, ``Transport`` itself
    by default (``LowComm(transports=...)``): a subclass may wrap the collectives, to shape or
    record what they carry."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, meter: ByteMeter | None = None
    ) -> None:
        """Collectives over ``group`` (None: the default world), counted in ``meter`` (a new
        one if None)."""
        # a group built from a store (an elastic quorum's) is not in torch's default world
        self._detached = group is not None and not _registered(group)
        if not self._detached and (not dist.is_available() or not dist.is_initialized()):
            raise RuntimeError(
                "lowcomm needs torch.distributed initialised: launch with `torchrun` or "
                "`lowcomm train --workers M`, or call torch.distributed.init_process_group first"
            )
        self.group = group
        _LIVE.add(self)
        shutdown_at_exit()
        self.meter = meter if meter is not None else ByteMeter()
        if self._detached:
            assert group is not None
            self.rank, self.world_size = group.rank(), group.size()
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self._pool: ThreadPoolExecutor | None = None
        # A backend moves tensors of some device types only (NCCL: CUDA; gloo: CPU here, its
        # CUDA support being partial); a tensor of another type is staged through one it takes
        # and handed back where it came from (see :meth:`_stage`).
        backend = group.name() if self._detached else dist.get_backend(group)
        self.takes = device_types(str(backend))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.takes == {"cuda"}
            else torch.device("cpu")
        )

    # -- staging ---------------------------------------------------------------------------------
    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself where this group's backend takes its device; else a copy on one it
        takes: a CUDA tensor on a gloo group goes through pinned host memory (the shape that
        lets workers share a GPU), a CPU tensor on an NCCL group through this rank's GPU."""
        if t.device.type in self.takes:
            return t
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t)  # a copy to the host waits for the kernels that made t
        return t.to(self.device)

    def _landing(self, t: torch.Tensor) -> torch.Tensor:
        """Where a receive into ``t`` lands: ``t`` itself where the backend takes its device,
        else an empty buffer like it on one that it takes (pinned host memory for CUDA)."""
        if t.device.type in self.takes:
            return t
        if t.device.type == "cuda":
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return torch.empty(t.shape, dtype=t.dtype, device=self.device)

    @staticmethod
    def _unstage(buf: torch.Tensor, t: torch.Tensor) -> None:
        """Write a staged result back into ``t`` (nothing when ``t`` was used itself)."""
        if buf is not t:
            t.copy_(buf)

    # -- collectives (blocking; call from the comm thread for overlap) ------------------------
    def all_reduce(self, t: torch.Tensor, control: bool = False, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` in place across workers (``op``: sum or max); returns it."""
        m = self.world_size
        n = _nbytes(t)
        buf = self._stage(t)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        dist.all_reduce(buf, op=reduce_op, group=self.group)
        self._unstage(buf, t)
        wire = ring_all_reduce_bytes(n, m)
        self.meter.record(n, wire, wire, control)
        return t

    def all_gather(self, t: torch.Tensor, control: bool = False) -> list[torch.Tensor]:
        """Every worker's ``t`` (all equal in shape and dtype), in rank order."""
        m = self.world_size
        src = self._stage(t.contiguous())
        out = [torch.empty_like(src) for _ in range(m)]
        dist.all_gather(out, src, group=self.group)
        n = _nbytes(t)
        self.meter.record(n, (m - 1) * n, (m - 1) * n, control)
        return [o.to(t.device) for o in out]

    def all_to_all(self, chunks: list[torch.Tensor], control: bool = False) -> list[torch.Tensor]:
        """Send ``chunks[j]`` to worker j; returns what each worker sent here, in rank order.

        All chunks must have one shape and dtype (codecs give equal sizes for equal shapes).
        """
        m = self.world_size
        if len(chunks) != m:
            raise ValueError(f"all_to_all needs {m} chunks, got {len(chunks)}")
        flat_in = self._stage(torch.stack([c.contiguous() for c in chunks]))
        flat_out = torch.empty_like(flat_in)
        dist.all_to_all_single(flat_out, flat_in, group=self.group)
        n = _nbytes(flat_in)
        wire = (m - 1) / m * n
        self.meter.record(n, wire, wire, control)
        return list(flat_out.to(chunks[0].device).unbind(0))

    def all_reduce_async(self, t: torch.Tensor, control: bool = False) -> torch.futures.Future:
        """Start a sum all-reduce of ``t`` in place; returns a Future of ``t``
        (for DDP comm hooks)."""
        m = self.world_size
        n = _nbytes(t)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        wire = ring_all_reduce_bytes(n, m)
        self.meter.record(n, wire, wire, control)
        return work.get_future().then(lambda fut: fut.value()[0])

    def broadcast(self, t: torch.Tensor, src: int = 0, control: bool = True) -> torch.Tensor:
        """Copy the group's rank ``src``'s ``t`` into every worker's ``t`` in place
        (control traffic by default). ``src`` counts within this transport's group."""
        m = self.world_size
        n = _nbytes(t)
        buf = self._stage(t)
        # torch's src is a global rank; in a replica group rank 0 is not global rank 0
        if self._detached:
            dist.broadcast(buf, group=self.group, group_src=src)
        else:
            dist.broadcast(buf, src=self._global_rank(src), group=self.group)
        self._unstage(buf, t)
        wire = (m - 1) / m * n
        self.meter.record(n if self.rank == src else 0, wire, wire, control)
        return t

    def exchange_p2p(
        self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], control: bool = True
    ) -> None:
        """Send ``sends[j]`` to group rank j and receive into ``recvs[i]`` from group rank i,
        all posted at once (no order to deadlock on), then wait for all: the heal's stripes go
        only where they are needed."""
        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None
        landings = {i: self._landing(t) for i, t in recvs.items()}
        works = [group.send([self._stage(t.contiguous())], j, 0) for j, t in sends.items()]
        works += [group.recv([landings[i]], i, 0) for i in recvs]
        for w in works:
            w.wait()
        for i, t in recvs.items():
            self._unstage(landings[i], t)
        sent = sum(_nbytes(t) for t in sends.values())
        self.meter.record(sent, sent, sum(_nbytes(t) for t in recvs.values()), control)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s picklable ``obj`` on every rank (control traffic: not metered)."""
        box = [obj]
        if self._detached:
            dist.broadcast_object_list(box, group=self.group, group_src=src)
        else:
            dist.broadcast_object_list(box, src=self._global_rank(src), group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in group rank order (control traffic: not metered)."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def barrier(self) -> None:
        """Wait until every rank of the group gets here."""
        dist.barrier(group=self.group)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- asynchrony ------------------------------------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> Future:
        """Run ``fn`` (a sequence of collectives) on the ordered comm thread; returns a Future.

        On a GPU it runs on the comm thread's own CUDA stream (:func:`_on_side_stream`), so
        the exchange's kernels and host waits never hold up the compute stream."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowcomm-comm")
        return self._pool.submit(_on_side_stream(fn))

    def wait(self, fut: Future) -> T:
        """Block until ``fut`` is done, counting the time as blocked on the network."""
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.meter.add_blocked(time.perf_counter() - t0)

    def blocking(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` now and wait for it, counting its whole time as blocked.

        Once the comm thread exists the work goes through it, behind anything queued there, so
        every worker still issues its collectives in one order.
        """
        if self._pool is not None:
            return self.wait(self.submit(fn))
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.meter.add_blocked(time.perf_counter() - t0)

    def close(self) -> None:
        """Finish queued work and stop the comm thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def release(self) -> None:
        """Stop the comm thread and drop the process group (at exit: no collective after)."""
        self.close()
        self.group = None


class TransportWrapper:
    """A transport that hands every call to another one (``inner``) but those a subclass
    overrides: the way to shape, spoil or record what a run's collectives carry, through the
    engine's transport factory (``LowComm(transports=lambda group, meter:
    MyWrapper(Transport(group, meter)))``). An override calls ``self.inner``'s collective."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# Every transport, so that interpreter exit can let go of their process groups (see
# release_all): a group must be destroyed while Python is still whole.
_LIVE: weakref.WeakSet[Transport] = weakref.WeakSet()


_SIDE: dict[int, torch.cuda.Stream] = {}  # the comm thread's stream, per GPU


def _on_side_stream(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` to run on the comm thread's own CUDA stream (``fn`` itself where CUDA is not in
    use): it starts after the work queued on the caller's stream so far (what it reads was
    made there) and returns once its own work is done, so the caller may use what it made
    as soon as the Future is. Its host waits (a flag read, a copy to pinned memory) then wait
    for its own stream only, not for the training kernels queued behind the send."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return fn
    device = torch.cuda.current_device()
    caller = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record()

    def run() -> T:
        with torch.cuda.device(device):
            if device not in _SIDE:  # one for the process's life (streams come from a pool)
                _SIDE[device] = torch.cuda.Stream(device)
            stream = _SIDE[device]
            try:
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    out = fn()
            finally:  # its kernels done before anything it read is freed or reused
                stream.synchronize()
            # what it made is used on the caller's stream: the allocator must not hand its
            # memory to the next job on this stream while the caller's kernels read it
            for t in tensors_in(out):
                if t.is_cuda:
                    t.record_stream(caller)
        return out

    return run


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor held in ``obj``: in dataclasses, dicts, lists and tuples, at any depth."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether torch's default world knows ``group`` (made by new_group / init_process_group)."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {})
    return group in pg_map or group is dist.GroupMember.WORLD


def release_all() -> None:
    """Release every live transport's process group."""
    for t in list(_LIVE):
        t.release()


def shutdown() -> None:
    """Tear torch.distributed down in the one order that exits cleanly with gloo.

    A process group must be freed on the main thread while its own threads are idle. Freed by
    the garbage collector running in one of gloo's threads (a future's callback allocates,
    collection starts there and reaches a comm hook's state holding the group), the thread
    joins itself and the process aborts ("Resource deadlock avoided"); left to interpreter
    exit, a still-joinable thread aborts it ("terminate called without an active exception").
    So: no automatic collection meanwhile; hold every group; stop our comm threads; collect;
    destroy; give gloo's threads a moment to drop the work they just finished; let go of the
    groups here, on this thread.
    """
    initialized = dist.is_available() and dist.is_initialized()
    held = list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}))
    automatic = gc.isenabled()
    gc.disable()
    try:
        with contextlib.suppress(Exception):
            release_all()
        gc.collect()
        if initialized:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        gc.collect()
        if held:
            time.sleep(0.05)
        del held
        gc.collect()
    finally:
        if automatic:
            gc.enable()


_EXIT_HOOKED = False


def shutdown_at_exit() -> None:
    """Run :func:`shutdown` at interpreter exit (once), for scripts that never tear down."""
    global _EXIT_HOOKED
    if not _EXIT_HOOKED:
        _EXIT_HOOKED = True
        atexit.register(shutdown)
