"""The codebase's own rules, checked: layers that hold at import time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "lowcomm"
MATH_MODULES = ["codecs", "compensation.py", "outer.py", "schedule.py", "aggregate"]


@pytest.mark.parametrize(
    "module", ["lowcomm.lab.sim", "lowcomm.schedule", "lowcomm.config", "lowcomm.errors"]
)
def test_light_modules_import_without_torch(module):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_math_modules_never_touch_torch_distributed():
    files = [
        p
        for m in MATH_MODULES
        for p in ([SRC / m] if m.endswith(".py") else sorted((SRC / m).rglob("*.py")))
    ]
    bad = [
        str(p.relative_to(SRC))
        for p in files
        if any(
            n == "torch.distributed"
            or n.startswith("torch.distributed.")
            or n.endswith("transport")
            or ".transport." in n
            for n in _imports(p)
        )
    ]
    assert not bad, f"math modules importing torch.distributed: {bad}"


def test_engines_meet_the_protocols():
    from helpers import adamw, tiny_model

    from lowcomm.engine import LowComm
    from lowcomm.lab.peers.torchft import TorchftDiLoCo
    from lowcomm.protocols import CheckpointableEngine, SyncEngine

    model = tiny_model()
    engine = LowComm(model, adamw(model))
    assert isinstance(engine, SyncEngine) and isinstance(engine, CheckpointableEngine)
    for name in ("__enter__", "__exit__", "finish", "global_parameters"):
        assert callable(getattr(TorchftDiLoCo, name))
