"""A sync launches as many kernels for a model of many tensors, or many buckets, as for one of
few, on every device: the operators a sync dispatches (views left out: they launch nothing),
counted on both the training thread and the comm thread, are the same for a model of 6 blocks
(24 tensors) and one of 12 (48), and for one bucket and several. The collectives are counted
apart (one per bucket). A sync reads the device once at most (a value, a list, a boolean mask,
``nonzero``, ``unique``, ``bincount``), for every method and every combine rule.

And the path is one: the plan functions and kernel operations a sync calls are the same with
the CPU's choice of kernels and with the choice a GPU makes (:func:`lowcomm.codecs.kernels.
choose` patched, as a test can: Triton is not installed here and a CUDA device cannot be faked
on a CPU build of torch). ``lowcomm bench sync --device cuda --launches`` counts the kernels and
the host synchronisations themselves on a GPU."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lowcomm
from lowcomm import transport

H = 10
WIDTH = 32  # every fragment under one CPU chunk (outer.CHUNK): the chunking is the CPU's own
BIG, SMALL = 64.0, 0.004  # bucket_mb: one bucket, and several (about 1000 elements each)

#: operators that read the device from the host: a value, or a result whose size depends on it
HOST_READS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten.bincount",
)

#: every method, and every combine rule on the exchange that runs it
CASES = {
    "diloco": ("diloco", {}),
    "streaming": ("streaming", {"fragments": 2, "blocks_per_fragment": 0}),
    "sparseloco": ("sparseloco", {}),
    "co2": ("co2", {}),
    "two-phase-ef": ("diloco", {"codec": "int4", "reduce": "two-phase", "compensation": "ef"}),
    "gather-fp32": ("diloco", {"codec": "fp32", "reduce": "gather"}),
    "bf16-allreduce": ("diloco", {"codec": "bf16"}),
    "topk-4-bit-table": ("sparseloco", {"value_bits": 4}),
    "topk-fp32-values": ("sparseloco", {"value_bits": 32}),
    "int8-gather": ("diloco", {"codec": "int8", "reduce": "gather"}),
    **{
        rule: ("diloco", {"codec": "int8", "reduce": "gather", "aggregation": rule})
        for rule in ("median", "trimmed-mean", "centered-clip", "norm-clip", "cosine-clip")
    },
    **{
        f"topk-{rule}": ("sparseloco", {"aggregation": rule})
        for rule in ("norm-clip", "cosine-clip", "share-clip")
    },
}


def _on_device(t: object) -> bool:
    """Whether a tensor read would be of the device on a GPU: the control flags (int64) are
    a CPU tensor on every device, and reading them costs no synchronisation."""
    return not (isinstance(t, torch.Tensor) and t.dtype == torch.int64)


class _Count(TorchDispatchMode):
    """Counts dispatched operators that may launch a kernel (not views, not detach), those
    that read the device (HOST_READS, and indexing by a boolean mask), and collectives (their
    own operators, inside the transport, not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()
        self.collectives = 0
        self.lock = threading.Lock()
        self.inside = threading.local()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(self.inside, "collective", False):
            return func(*args, **(kwargs or {}))
        name = str(func)
        aliases = [r.alias_info for r in func._schema.returns]
        if not any(a is not None and not a.is_write for a in aliases):
            if not name.startswith(("aten.detach", "aten.lift")):
                with self.lock:
                    self.ops[name] += 1
        reads = name.startswith(HOST_READS) and _on_device(args[0])
        if reads or (name.startswith(("aten.index.", "aten.index_put")) and _masks(args[1])):
            self.read(name)
        return func(*args, **(kwargs or {}))

    def read(self, name: str) -> None:
        with self.lock:
            self.reads[name] += 1

    def clear(self) -> None:
        self.ops.clear()
        self.reads.clear()
        self.collectives = 0


def _masks(indices) -> bool:
    """Whether an indexing operator's indices hold a boolean mask (the result's size, or the
    positions written, depend on the data)."""
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or [])


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


def _per_sync(case: str, blocks: int, bucket_mb: float, counter: _Count) -> dict:
    """Operators per sync of a round of H steps in the block, less those of H plain steps;
    collectives, host reads per sync; the buckets of the first fragment."""
    strategy, extra = CASES[case]
    torch.manual_seed(0)
    model = _Blocks(blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cfg = lowcomm.preset_config(strategy, workers=1, sync_every=H, bucket_mb=bucket_mb, **extra)
    with (engine := lowcomm.LowComm(model, opt, cfg)):
        for _ in range(2 * H):  # buffers, plans and error feedback exist
            step()
        idle = lambda: engine.transport.blocking(lambda: None)  # noqa: E731
        idle()  # the window opens and closes with nothing in flight on the comm thread
        syncs0 = engine.stats.fragment_syncs
        counter.clear()
        with counter:
            for _ in range(H):
                step()
            idle()
            inside, reads = sum(counter.ops.values()), sum(counter.reads.values())
            collectives = counter.collectives
        syncs = engine.stats.fragment_syncs - syncs0
        buckets = len(engine.fragments[0].buckets)
    counter.clear()
    with counter:  # the same steps outside the block
        for _ in range(H):
            step()
    plain, plain_reads = sum(counter.ops.values()), sum(counter.reads.values())
    return {
        "ops": (inside - plain) / syncs,
        "reads": (reads - plain_reads) / syncs,
        "collectives": collectives / syncs,
        "syncs": syncs,
        "buckets": buckets,
    }


def _recorded(calls: list[str]) -> None:
    """Every plan function and kernel operation appends its name to ``calls`` when called."""
    from lowcomm.codecs import block, dense, kernels, lut, topk

    for cls in (block.BlockPlan, topk.TopKPlan, lut.LutPlan, dense.DensePlan):
        for name in ("encode", "decode", "select", "table"):
            if name in vars(cls):
                setattr(cls, name, _logging(getattr(cls, name), f"{cls.__name__}.{name}", calls))
    inside = [0]  # a kernel operation's own steps (a reference composed of others) are its own
    for op, impls in kernels._IMPLS.items():
        for impl in impls:
            impls[impl] = _logging(impls[impl], f"kernel.{op}", calls, inside)


def _logging(fn, name: str, calls: list[str], inside: list[int] | None = None):
    def run(*args, **kwargs):
        if inside is None:
            calls.append(name)
            return fn(*args, **kwargs)
        if not inside[0]:
            calls.append(name)
        inside[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            inside[0] -= 1

    return run


def _worker(rank: int, world: int, cases: list[str]) -> dict:
    from lowcomm.codecs import kernels

    counter = _Count()
    wrap = transport._on_side_stream
    tolist = torch.Tensor.tolist

    def counted_tolist(t: torch.Tensor) -> list:  # reads without dispatching an operator
        if _on_device(t):
            counter.read("tolist")
        return tolist(t)

    torch.Tensor.tolist = counted_tolist  # a spawned worker's own torch

    def counted(fn):  # the comm thread's work is counted too
        def run():
            with counter:
                return fn()

        return wrap(run)

    transport._on_side_stream = counted
    for name in ("all_reduce", "all_gather", "all_to_all"):  # collectives: counted apart
        inner = getattr(transport.Transport, name)

        def collective(self, *a, _inner=inner, **k):
            counter.collectives += 1
            counter.inside.collective = True
            try:
                return _inner(self, *a, **k)
            finally:
                counter.inside.collective = False

        setattr(transport.Transport, name, collective)
    out = {}
    for case in cases:
        out[case] = {
            "few": _per_sync(case, 6, BIG, counter),
            "many": _per_sync(case, 12, BIG, counter),
            "buckets": _per_sync(case, 6, SMALL, counter),
        }
    calls: list[str] = []
    _recorded(calls)
    real = kernels.choose
    for case in cases:
        sequences = []
        for device in ("cpu", "cuda"):  # this CPU's choice, then a GPU's
            kernels.choose = lambda _d, mode="auto", _on=device: real(torch.device(_on), mode)
            calls.clear()
            _per_sync(case, 6, BIG, counter)
            sequences.append(list(calls))
        kernels.choose = real
        out[case]["calls"] = sequences
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    from conftest import run_workers

    (got,) = run_workers(_worker, 1, list(CASES), tmp_path=tmp_path_factory.mktemp("launches"))
    return got


@pytest.mark.parametrize("case", list(CASES))
def test_a_sync_dispatches_as_many_operators_for_more_tensors_and_buckets(counted, case):
    got = counted[case]
    few, many, split = got["few"], got["many"], got["buckets"]
    assert few["syncs"] == many["syncs"] == split["syncs"] > 0
    assert few["buckets"] == 1 and split["buckets"] >= 3
    assert few["ops"] > 0
    assert many["ops"] == few["ops"], f"{case}: {few['ops']} for 24 tensors, {many['ops']} for 48"
    assert split["ops"] == few["ops"], f"{case}: {few['ops']} for 1 bucket, {split['ops']} for more"
    assert split["collectives"] > few["collectives"]  # (one per bucket: the allowed growth)


@pytest.mark.parametrize("case", list(CASES))
def test_a_sync_reads_the_device_once_at_most(counted, case):
    for size in ("few", "many", "buckets"):
        assert counted[case][size]["reads"] <= 1, (case, size, counted[case][size]["reads"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_sync_calls_the_same_plan_functions_on_the_cpu_and_a_gpu(counted, case):
    cpu, gpu = counted[case]["calls"]
    assert cpu and cpu == gpu
