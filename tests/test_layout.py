"""The shape of the source tree: imports point one way, each module says what it is for.

Import graph. Nodes are lowcomm's modules (``lowcomm/x/__init__.py`` is the node ``lowcomm.x``).
An edge A -> B is an explicit import statement in A that names B, wherever it is: at module level,
inside a function, or under ``if TYPE_CHECKING:`` (lazy and typing-only imports count: they are
the same dependency, only deferred). Relative imports are resolved against A's package.

- ``import lowcomm.a.b`` and ``from lowcomm.a import b`` (b a submodule) are edges to
  ``lowcomm.a.b`` only. Python also initialises the parent packages on the way, but that implicit
  step is not an edge: otherwise a package ``__init__`` that re-exports its submodules would form
  a cycle with each of them, which is the normal shape of a package.
- ``from lowcomm.a import name`` (name not a submodule) and ``from . import name`` are edges to the
  package ``lowcomm.a`` itself: a submodule that reads names from its own package's ``__init__``
  while that ``__init__`` imports the submodule is a real cycle, and is reported.
- ``importlib.import_module`` with a computed name (lowcomm/__init__'s lazy attributes) is not
  seen.

The graph must have no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "lowcomm"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lowcomm modules that ``name`` (at ``path``) imports, by the rules in the docstring."""
    here = name if _is_package(path) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{stem}.{alias.name}"
                targets.append(sub if sub in modules else stem)
        else:
            continue
        for target in targets:
            # `import lowcomm.a.b.name`-like forms: the longest prefix that is a module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """lowcomm's module import graph (see the module docstring for what counts as an edge)."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _src_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(SRC.parent).as_posix()


def test_the_graph_sees_lazy_relative_and_typing_imports(tmp_path):
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import sib\n"  # a sibling module
        "from .. import name\n"  # a name of the parent package's __init__
        "if TYPE_CHECKING:\n"
        "    from ..q.r import T\n"
        "def f():\n"
        "    import p.q\n"
        "    from p.q import s\n"
    )
    (tmp_path / "mod.py").write_text(source)
    modules = {m: tmp_path for m in ("p", "p.q", "p.q.r", "p.q.s", "p.a", "p.a.sib", "p.a.mod")}
    found = _imports("p.a.mod", tmp_path / "mod.py", modules)
    assert found == {"p.a.sib", "p", "p.q.r", "p.q", "p.q.s"}
    graph = import_graph()
    assert "lowcomm.train.tokenizer" in graph["lowcomm.train.data"]  # lazy, in load_corpus
    assert "lowcomm.lab.sim.cli" in graph["lowcomm.lab.sim.__main__"]
    # the rule for packages: a package's own re-exports do not make it a cycle
    assert find_cycles({"p": {"p.a"}, "p.a": {"p.b"}, "p.b": set()}) == []
    assert find_cycles({"p": {"p.a"}, "p.a": {"p"}}) == [["p", "p.a"]]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among lowcomm's modules: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


LAB = f"{PACKAGE}.lab"


def _in_lab(module: str) -> bool:
    return module == LAB or module.startswith(f"{LAB}.")


def test_the_core_imports_nothing_of_the_lab():
    """The core (every module outside ``lowcomm.lab``) imports nothing of the lab: not at
    module level, not lazily inside a function, not for typing. The lab finds the core's
    extension points by registering itself (``lowcomm.plugins``)."""
    graph = import_graph()
    leaks = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if not _in_lab(name)
        for target in targets
        if _in_lab(target)
    ]
    assert not leaks, leaks


def test_the_lab_stands_above_the_core():
    """Every arrow between the two runs from the lab down into the core, and the lab uses the
    core at all (a lab that imported nothing would pass the test above vacuously)."""
    graph = import_graph()
    down = [(n, t) for n, ts in graph.items() if _in_lab(n) for t in ts if not _in_lab(t)]
    assert {t for _, t in down} >= {f"{PACKAGE}.engine", f"{PACKAGE}.train.extensions"}, down
    assert not [(n, t) for n, ts in graph.items() if not _in_lab(n) for t in ts if _in_lab(t)]


def test_a_run_of_the_core_loads_no_lab_module(tmp_path):
    """``lowcomm train`` of a core method, end to end in one process (a world of one under a
    torchrun-like environment), with the lab installed beside it: no lab module is imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from lowcomm.cli import main\n"
        f"code = main(['train', '--strategy', 'diloco', '--out', {str(tmp_path / 'run')!r},\n"
        "             'model=tiny', 'steps=4', 'sync_every=2', 'batch_size=2', 'seq_len=16',\n"
        "             'eval_batches=1', 'eval_every=0', 'progress=false'])\n"
        "lab = sorted(m for m in sys.modules if m.startswith('lowcomm.lab'))\n"
        "assert code == 0 and not lab, (code, lab)\n"
    )
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    import os

    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rounds_alone_changes_its_counters():
    """Quorum rounds' counters (cut rounds and steps, late syncs) change inside
    ``elastic/rounds.py`` only; the engine tells it what happened (``cut``, ``missed``)."""
    counters = {"cut_rounds", "cut_steps", "late_syncs"}
    found = []
    for path in _src_files():
        if path.name == "rounds.py" and path.parent.name == "elastic":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in counters:
                    found.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(t)}")
    assert not found, found


def test_the_protocol_reads_requests_by_their_typed_fields():
    """``elastic/`` reads a quorum request's fields from :class:`~lowcomm.elastic.messages.
    Request` (typed, checked once by ``from_wire``), never as string keys of the wire's dict
    (``d["site"]``, ``d.get("join")``), outside ``messages.py``."""
    import dataclasses

    from lowcomm.elastic.messages import Request

    keys = {f.name for f in dataclasses.fields(Request)} | {"mac"}
    found = []
    for path in sorted((SRC / PACKAGE / "elastic").glob("*.py")):
        if path.name == "messages.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key = node.slice.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                key = node.args[0].value
            if key in keys:
                found.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_trainer_does_not_reach_up_into_hf():
    graph = import_graph()
    hf = [m for m in graph if m == "lowcomm.hf" or m.startswith("lowcomm.hf.")]
    into_hf = sorted(m for m, deps in graph.items() if m not in hf and set(deps) & set(hf))
    # one composing function builds `model=hf:...` models for the trainer: lowcomm.train.build
    assert [m for m in into_hf if m.startswith("lowcomm.train")] == ["lowcomm.train.build"]
    assert not any(d.startswith("lowcomm.train") for m in hf for d in graph[m])


def test_every_module_opens_with_a_docstring():
    missing = [_rel(p) for p in _src_files() if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, f"modules without a docstring: {missing}"


# --- one name, one place: the counts the structure issue set, kept by scans ---------------------


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_takes_a_runs_settings_apart():
    """A run's settings travel as one tree (a Configs, in a RunSpec): nothing takes them one
    by one."""
    apart = []
    for path in _src_files():
        for fn in _functions(ast.parse(path.read_text())):
            args = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            if "strategy" in args and args & {"sync_cfg", "sync"} and args & {"cfg", "train"}:
                apart.append(f"{_rel(path)}:{fn.lineno} {fn.name}")
    assert not apart, apart


def test_no_engine_typed_any_and_nothing_set_on_it_from_outside():
    """Parameters and attributes called ``engine`` are typed; only the engine's own class
    assigns the engine's attributes (``engine.x = ...`` or ``setattr(engine, ...)`` elsewhere
    is a part the class does not declare)."""
    found = []
    for path in _src_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.arg, ast.AnnAssign)):
                name = node.arg if isinstance(node, ast.arg) else ast.unparse(node.target)
                note = node.annotation
                if name.split(".")[-1] == "engine" and note is not None:
                    if ast.unparse(note) in ("Any", "typing.Any"):
                        found.append(f"{_rel(path)}:{node.lineno}: {name}: Any")
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value).endswith("engine"):
                    found.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(t)} = ...")
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "setattr"
                and ast.unparse(node.args[0]).endswith("engine")
            ):
                found.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
