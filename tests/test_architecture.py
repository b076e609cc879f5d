"""The rules of the house, read off the source: what may import what, no import cycles, and a
module map (docs/explanation/architecture.md) that lists exactly the modules the tree holds.

Imports are read with `ast` from every module, including imports inside functions (a call-time
import is still a dependency; it only hides a cycle). Imports under `if TYPE_CHECKING:` are not
dependencies at run time and are left out.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tracker", "harvester")
# The application library's modules that are not its public API: the sidecar may not use them.
TRACKER_PRIVATE = ("tracker.core", "tracker.drivers")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports (a `from package import module` names the
    module; `from package import name` names the package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if _type_checking_block(node):
            skip.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {m for m in found if m in known and m != name}


def graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(edges: dict[str, set[str]]) -> list[str]:
    broken = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if source.startswith("tracker") and target.startswith("harvester"):
                broken.append(f"{source} imports {target}: the application library never imports the sidecar")
            if source.startswith("harvester") and target.startswith(TRACKER_PRIVATE):
                broken.append(f"{source} imports {target}: the sidecar uses only the tracker's public modules")
            if target == "harvester.cli" and source != "harvester.cli":
                broken.append(f"{source} imports harvester.cli: nothing imports the command line")
    return broken


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    return graph(ROOT)


def test_import_rules_hold(edges: dict[str, set[str]]) -> None:
    assert violations(edges) == []


def test_no_import_cycles(edges: dict[str, set[str]]) -> None:
    assert cycles(edges) == []


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """The rules above pass only if the checker can see a violation: feed it a tree that breaks each."""
    (tmp_path / "tracker" / "core").mkdir(parents=True)
    (tmp_path / "harvester").mkdir()
    files = {
        "tracker/__init__.py": "from tracker import sync\n",
        "tracker/sync.py": "def f():\n    from tracker import outbox  # a call-time import still counts\n",
        "tracker/outbox.py": "import tracker.sync\nfrom harvester import run\n",
        "tracker/core/__init__.py": "",
        "tracker/core/steps.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import harvester.run\n",
        "harvester/__init__.py": "",
        "harvester/run.py": "from tracker.core import steps\nfrom . import cli\n",
        "harvester/cli.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    seen = graph(tmp_path)
    assert cycles(seen) == [["tracker.outbox", "tracker.sync"]]
    assert violations(seen) == [
        "harvester.run imports harvester.cli: nothing imports the command line",
        "harvester.run imports tracker.core.steps: the sidecar uses only the tracker's public modules",
        "tracker.outbox imports harvester.run: the application library never imports the sidecar",
    ]


MAP_ROW = re.compile(r"^\|\s*`([\w/]+(?:\.py|/))`\s*\|", re.M)


def test_the_module_map_lists_every_module_and_nothing_else() -> None:
    """docs/explanation/architecture.md's module map names each module (and each package, as `folder/`) once."""
    doc = (ROOT / "docs" / "explanation" / "architecture.md").read_text()
    listed = MAP_ROW.findall(doc)
    assert len(listed) == len(set(listed)), "a module is listed twice"
    present = set()
    for path in modules(ROOT).values():
        rel = path.relative_to(ROOT).as_posix()
        present.add(rel[: -len("__init__.py")] if path.name == "__init__.py" else rel)
    assert sorted(set(listed) - present) == [], "listed in docs/explanation/architecture.md but not in the tree"
    assert sorted(present - set(listed)) == [], "in the tree but missing from docs/explanation/architecture.md's map"


def test_every_package_ships_in_the_distribution() -> None:
    """pyproject.toml names its packages one by one: a new folder missing there would be left out of
    the wheel while every test, run from the checkout, still passed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {
        module_name(ROOT, p.parent / "__init__.py") for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")
    }
    assert sorted(present - listed) == []
