"""The layout holds: the library's imports against docs/parts.json, no import circle, and the line budgets.

docs/parts.json draws the parts (framework, runtime, lab, backends, transports, the door) and the imports that must
never exist; tools/lines.py keeps the budgets. Every import counts, at a module's top or inside a function, and
under ``TYPE_CHECKING`` too: a reader follows them all.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("lines", ROOT / "tools/lines.py")
lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lines)


def module_file(name: str) -> Path | None:
    """The library file a dotted module name is, or None for a module outside the library."""
    if name.split(".")[0] not in lines.LIBRARY:
        return None
    base = Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if (ROOT / path).is_file():
            return path
    return None


def imports_in(source: str, path: Path) -> set[Path]:
    """The library files ``path``'s code imports: ``from a.b import c`` is a/b/c.py when that is a module, else a/b."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if module_file(n) else node.module for n in names]
        else:
            continue
        found |= {f for f in map(module_file, names) if f is not None and f != path}
    return found


GRAPH = {path: imports_in((ROOT / path).read_text(), path) for path in lines.library_files()}


def test_every_library_file_is_on_a_part():
    table = lines.parts()
    assert [str(p) for p in GRAPH if lines.part_of(p, table) is None] == []


def test_no_import_runs_where_the_picture_says_never():
    picture = json.loads((ROOT / "docs/parts.json").read_text())
    never = {(a, b): why for a, b, why in picture["never"]}
    table = lines.parts()
    broken = []
    for path, targets in GRAPH.items():
        for target in targets:
            pair = (lines.part_of(path, table), lines.part_of(target, table))
            if pair in never:
                broken.append(f"{path} -> {target}: {pair[0]} never imports {pair[1]} ({never[pair]})")
    assert broken == []


def test_no_import_circle():
    """Tarjan's strongly connected components of the file graph: every one is a single file."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    circles = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                circles.append(sorted(map(str, [v, *component])))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_parts_and_the_reading_path_stay_within_their_budgets():
    assert lines.over_budget(lines.measure()) == []


def test_no_file_over_400_lines_and_no_function_over_60():
    assert lines.over_limits() == []


def test_no_two_library_files_and_no_two_classes_share_a_name():
    """A name says which room a reader is in: each file and each top-level class is named once (``__init__.py``,
    ``__main__.py`` and the two contracts named ``base.py`` by the architecture aside)."""
    names: dict[str, list[str]] = {}
    for path in GRAPH:
        if path.name not in ("__init__.py", "__main__.py", "base.py"):
            names.setdefault(path.name, []).append(str(path))
        for node in ast.parse((ROOT / path).read_text()).body:
            if isinstance(node, ast.ClassDef):
                names.setdefault(f"class {node.name}", []).append(str(path))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def test_the_reading_path_names_files_that_exist():
    path = lines.reading_path()
    assert path and [str(p) for p in path if not (ROOT / p).is_file()] == []


@pytest.mark.parametrize(
    "source, imports",
    [
        ("import tinyconv.model\n", {"tinyconv/model.py"}),
        ("from tinyconv import model\n", {"tinyconv/model.py"}),
        ("from tinyconv.model import Network\n", {"tinyconv/model.py"}),
        ("def f():\n    from backends.base import Backend\n", {"backends/base.py"}),
        ("import numpy\nfrom . import x\n", set()),
    ],
)
def test_the_import_reader_finds_each_kind_of_import(source, imports):
    """The reader the checks above rest on: top-level, from-module, from-package and function-level imports."""
    assert {str(p) for p in imports_in(source, Path("tinyconv/probe.py"))} == imports
