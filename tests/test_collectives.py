"""Every collective goes through :class:`lowcomm.transport.Transport`, which stages each tensor
through a device its group's backend takes (a CPU tensor on an NCCL group, a CUDA tensor on a
gloo group): one stray ``dist.all_reduce`` of a CPU tensor is what stopped every CUDA run at its
summary. A source scan keeps new ones out; the staging rule is tested on CPU with stand-ins."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lowcomm.transport import Transport, device_types

SRC = Path(__file__).resolve().parent.parent / "src" / "lowcomm"

# torch.distributed's functions that move data between ranks
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "scatter", "scatter_object_list", "send",
    "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list",
}  # fmt: skip

# the files that may name one, each with its reason
ALLOWED = {
    "transport.py": "the one place collectives are issued",
    "lab/ddp_hooks.py": "meters torch's own dist.all_reduce inside DDP comm hooks (wraps it)",
    "train/sites.py": "FSDP2's custom all-gather and reduce-scatter, on FSDP2's own mesh groups "
    "and buffers: the collective FSDP2 would issue, metered",
}


def _dist_names(tree: ast.AST) -> set[str]:
    """The local names ``torch.distributed`` is bound to in a module (``dist`` mostly)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def _collectives_named(path: Path, root: Path = SRC) -> list[str]:
    """``dist.<collective>`` (or ``torch.distributed.<collective>``) named anywhere in ``path``,
    called or aliased, and collectives imported by name from torch.distributed."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, found, where = _dist_names(tree), [], path.relative_to(root)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            base = ast.unparse(node.value)
            if base in aliases or base == "torch.distributed":
                found.append(f"{where}:{node.lineno} {base}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [
                f"{where}:{node.lineno} {a.name}" for a in node.names if a.name in COLLECTIVES
            ]
    return found


def test_no_collective_outside_transport():
    stray = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in ALLOWED
        for hit in _collectives_named(path)
    ]
    assert not stray, "collectives outside Transport (use lowcomm.transport.Transport):\n" + (
        "\n".join(stray)
    )


def test_the_scan_finds_calls_aliases_and_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch.distributed as d\nimport torch\nfrom torch.distributed import barrier\n"
        "g = getattr(d, 'x', d.all_gather_into_tensor)\ntorch.distributed.broadcast(t, 0)\n"
        "d.get_rank()\nother.all_reduce(t)\n"
    )
    assert sorted(_collectives_named(probe, tmp_path)) == [
        "probe.py:3 barrier",
        "probe.py:4 d.all_gather_into_tensor",
        "probe.py:5 torch.distributed.broadcast",
    ]


@pytest.mark.parametrize(
    "backend,takes",
    [
        ("gloo", {"cpu"}),
        ("nccl", {"cuda"}),
        ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
        ("CUDA:nccl, cpu:gloo", {"cpu", "cuda"}),
        ("undefined", {"cpu"}),
    ],
)
def test_backends_take_these_devices(backend, takes):
    assert device_types(backend) == takes


def _staging(rank, world):
    """The collectives the trainer and the site's ranks use, through a gloo Transport."""
    t = Transport()
    x = torch.full((3,), float(rank + 1))
    same = t._stage(x) is x
    t.all_reduce(x, op="max")
    y = torch.tensor([float(rank)])
    t.all_reduce(y)
    objs = t.all_gather_object({"rank": rank})
    got = t.broadcast_object(f"from {rank}", src=1)
    t.barrier()
    return same, x.tolist(), y.item(), objs, got


def test_transport_reduces_gathers_and_broadcasts_objects(workers):
    out = workers(_staging, 2)
    for same, x, y, objs, got in out:
        assert same  # gloo takes CPU tensors as they are
        assert x == [2.0, 2.0, 2.0] and y == 1.0
        assert objs == [{"rank": 0}, {"rank": 1}] and got == "from 1"
