"""The project's documentation stands alone and covers what the code offers.

Run as a script (``python tests/test_docs.py``) it prints the settings table of docs/api.md from
``SyncConfig``, so the table can be regenerated when a field or default changes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Built from pieces so that this file does not contain the strings it forbids.
_NOTES = ("ALGORITHMS", "DESIGN", "BENCHMARKS")
FORBIDDEN = ["../" + "shared", "shared" + "/"] + [name + ".md" for name in _NOTES]

# Strategy name (presets and the CLI) -> the heading of its section in docs/algorithms.md.
METHOD_SECTIONS = {
    "diloco": "DiLoCo",
    "streaming": "Streaming DiLoCo",
    "sparseloco": "SparseLoCo",
    "co2": "CO2",
    "loco": "LoCo",
}


def _project_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder in ("docs", "src", "tests", "benchmarks"):
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and p.suffix in (".md", ".py", ".toml", ".txt", ".cfg", ".json")
        ]
    return [p for p in files if p.exists()]


def test_nothing_points_outside_the_project() -> None:
    hits = []
    for path in _project_files():
        text = path.read_text(errors="replace")
        for needle in FORBIDDEN:
            if needle in text:
                line = text[: text.index(needle)].count("\n") + 1
                hits.append(f"{path.relative_to(ROOT)}:{line}: {needle}")
    assert not hits, "point to docs/ instead of the team's notes:\n" + "\n".join(hits)


def _headings(path: Path) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", path.read_text(), re.M)]


def test_every_method_has_a_section() -> None:
    from lowcomm import strategies

    methods = [s.name for s in strategies.REGISTRY.values() if not (s.baseline or s.peer)]
    unmapped = [s for s in methods if s not in METHOD_SECTIONS]
    assert not unmapped, f"add a section to docs/algorithms.md for {unmapped} and map it here"
    headings = _headings(DOCS / "algorithms.md")
    missing = [METHOD_SECTIONS[s] for s in methods if METHOD_SECTIONS[s] not in headings]
    assert not missing, f"docs/algorithms.md has no section for {missing}"


def format_default(value: object) -> str:
    """A default as the settings table writes it (1/64 rather than 0.015625)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value > 0 and (1 / value).is_integer() and 1 / value > 2:
        return f"1/{int(1 / value)}"
    return str(value)


def settings_table() -> str:
    """The rows of docs/api.md's settings table, generated from ``SyncConfig``."""
    from lowcomm.config import SyncConfig

    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(SyncConfig):
        rows.append(
            f"| `{f.name}` | `{format_default(f.default)}` | {f.metadata.get('help', '')} |"
        )
    return "\n".join(rows)


def test_every_setting_is_documented_with_its_default() -> None:
    from lowcomm.config import SyncConfig

    text = (DOCS / "api.md").read_text()
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, re.M))
    problems = []
    for f in dataclasses.fields(SyncConfig):
        if f.name not in documented:
            problems.append(f"{f.name}: missing")
        elif documented[f.name] != format_default(f.default):
            problems.append(
                f"{f.name}: docs say {documented[f.name]}, "
                f"the code's default is {format_default(f.default)}"
            )
    assert not problems, (
        "docs/api.md 'Every setting' is out of date (python tests/test_docs.py "
        "prints the table):\n" + "\n".join(problems)
    )


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_relative_links_resolve(page: str) -> None:
    path = DOCS / page
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        if not (path.parent / target).exists():
            broken.append(target)
    assert not broken, f"docs/{page} links to missing files: {broken}"


def test_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    missing = [p for p in pages if f"({p})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


if __name__ == "__main__":
    print(settings_table())
