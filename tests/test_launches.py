"""A sync on an accelerator launches as many kernels for a model of many tensors as for one of
few: the operators a sync dispatches (views left out: they launch nothing), counted on the
bucket path a GPU takes (``LOWCOMM_BATCH=1``), on both the training thread and the comm thread,
are the same for a model of 6 blocks and one of 12. ``lowcomm bench sync --device cuda
--launches`` counts the kernels themselves on a GPU."""

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


class _Count(TorchDispatchMode):
    """Counts dispatched operators that may launch a kernel (not views, not detach)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aliases = [r.alias_info for r in func._schema.returns]
        if not any(a is not None and not a.is_write for a in aliases):
            if not str(func).startswith(("aten.detach", "aten.lift")):
                with self.lock:
                    self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


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


def _per_sync(strategy: str, blocks: int, counter: _Count) -> tuple[float, int]:
    """Operators per sync of a round of H steps in the block, less those of H plain steps."""
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
        with counter:
            for _ in range(H):
                step()
            idle()
            inside = sum(counter.ops.values())
        syncs = engine.stats.fragment_syncs - syncs0
    counter.ops.clear()
    with counter:  # the same steps outside the block
        for _ in range(H):
            step()
    plain = sum(counter.ops.values())
    return (inside - plain) / syncs, syncs


def _worker(rank: int, world: int, strategy: str) -> dict:
    counter = _Count()
    wrap = transport._on_side_stream

    def counted(fn):  # the comm thread's work is counted too
        def run():
            with counter:
                return fn()

        return wrap(run)

    transport._on_side_stream = counted
    return {b: _per_sync(strategy, b, counter) for b in (6, 12)}


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "sparseloco", "co2"])
def test_a_sync_dispatches_as_many_operators_for_twice_the_tensors(workers, strategy, monkeypatch):
    monkeypatch.setenv("LOWCOMM_BATCH", "1")
    (got,) = workers(_worker, 1, strategy)
    (few, syncs_few), (many, syncs_many) = got[6], got[12]
    assert syncs_few == syncs_many > 0
    assert few > 0
    assert many == few, f"{strategy}: {few} operators a sync for 24 tensors, {many} for 48"
