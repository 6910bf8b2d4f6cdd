"""A sync on an accelerator launches as many kernels for a model of many tensors as for one of
few: the operators a sync dispatches (views left out: they launch nothing), counted on the
bucket path a GPU takes (``LOWCOMM_BATCH=1``, and the pseudo-gradient's finite check as a GPU
makes it, not fused into the CPU's kernel), on both the training thread and the comm thread,
are the same for a model of 6 blocks and one of 12; so are its reads of the device (a value,
a list, or a boolean mask), one a sync. ``lowcomm bench sync --device cuda --launches``
counts the kernels and the host synchronisations themselves on a GPU."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lowcomm
from lowcomm import transport
from lowcomm.engine import fragment

H = 10
WIDTH = 32  # every fragment under one CPU chunk (outer.CHUNK): the chunking is the CPU's own


#: operators that read the device from the host: a value, or a result whose size depends on it
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique")


def _on_device(t: object) -> bool:
    """Whether a tensor read would be of the device on a GPU: the control flags (int64) are
    a CPU tensor on every device, and reading them costs no synchronisation."""
    return not (isinstance(t, torch.Tensor) and t.dtype == torch.int64)


class _Count(TorchDispatchMode):
    """Counts dispatched operators that may launch a kernel (not views, not detach), and those
    that read the device (HOST_READS, and indexing by a boolean mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        aliases = [r.alias_info for r in func._schema.returns]
        if not any(a is not None and not a.is_write for a in aliases):
            if not name.startswith(("aten.detach", "aten.lift")):
                with self.lock:
                    self.ops[name] += 1
        reads = name.startswith(HOST_READS) and _on_device(args[0])
        if reads or (name.startswith("aten.index") and _masks(args)):
            self.read(name)
        return func(*args, **(kwargs or {}))

    def read(self, name: str) -> None:
        with self.lock:
            self.reads[name] += 1


def _masks(args) -> bool:
    """Whether an indexing operator was handed a boolean mask (its size depends on the data)."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                return True
    return False


class _Blocks(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH))
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _per_sync(strategy: str, blocks: int, counter: _Count) -> tuple[float, int, float]:
    """Operators per sync of a round of H steps in the block, less those of H plain steps; the
    syncs; host reads per sync."""
    torch.manual_seed(0)
    model = _Blocks(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    extra = {"fragments": 2, "blocks_per_fragment": 0} if strategy == "streaming" else {}
    cfg = lowcomm.preset_config(strategy, workers=1, sync_every=H, **extra)
    with (engine := lowcomm.LowComm(model, opt, cfg)):
        for _ in range(2 * H):  # buffers, plans and error feedback exist
            step()
        idle = lambda: engine.transport.blocking(lambda: None)  # noqa: E731
        idle()  # the window opens and closes with nothing in flight on the comm thread
        syncs0 = engine.stats.fragment_syncs
        counter.ops.clear()
        counter.reads.clear()
        with counter:
            for _ in range(H):
                step()
            idle()
            inside = sum(counter.ops.values())
            reads = sum(counter.reads.values())
        syncs = engine.stats.fragment_syncs - syncs0
    counter.ops.clear()
    counter.reads.clear()
    with counter:  # the same steps outside the block
        for _ in range(H):
            step()
    plain, plain_reads = sum(counter.ops.values()), sum(counter.reads.values())
    return (inside - plain) / syncs, syncs, (reads - plain_reads) / syncs


def _worker(rank: int, world: int, strategy: str) -> dict:
    counter = _Count()
    wrap = transport._on_side_stream
    jobs = [0]
    tolist = torch.Tensor.tolist

    def counted_tolist(t: torch.Tensor) -> list:  # reads without dispatching an operator
        if _on_device(t):
            counter.read("tolist")
        return tolist(t)

    torch.Tensor.tolist = counted_tolist  # a spawned worker's own torch
    fragment.fused_minus = lambda *a: None  # the finite check as a GPU makes it

    def counted(fn):  # the comm thread's work is counted too
        def run():
            jobs[0] += 1
            with counter:
                return fn()

        return wrap(run)

    transport._on_side_stream = counted
    got = {b: _per_sync(strategy, b, counter) for b in (6, 12)}
    return {**got, "comm_jobs": jobs[0]}


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "sparseloco", "co2"])
def test_a_sync_dispatches_as_many_operators_for_twice_the_tensors(workers, strategy, monkeypatch):
    monkeypatch.setenv("LOWCOMM_BATCH", "1")
    (got,) = workers(_worker, 1, strategy)
    if strategy in ("streaming", "co2"):  # their exchanges overlap, on the comm thread:
        assert got["comm_jobs"] > 0  # its work went through the counted wrapper
    (few, syncs_few, reads_few), (many, syncs_many, reads_many) = got[6], got[12]
    assert syncs_few == syncs_many > 0
    assert few > 0
    assert many == few, f"{strategy}: {few} operators a sync for 24 tensors, {many} for 48"
    # one read of the device: the pseudo-gradient's finite check for an all-reduce (whose
    # count the control flags give), the combine's for a gather (every sender's flag, the
    # finite check's among them); top-k's torch path adds its tie check (none under Triton)
    most = 2 if strategy == "sparseloco" else 1
    assert reads_many == reads_few <= most, f"{strategy}: {reads_few}, {reads_many} reads a sync"
