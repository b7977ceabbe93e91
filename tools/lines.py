"""tinyconv's line budget, kept as tinygrad keeps its own: the lines of each part, and of the reading path of one step.

    python tools/lines.py            # the table
    python tools/lines.py --check    # also exit 1 above a budget (tests/test_layout.py holds the same budgets)

A part is one of docs/parts.json's, the picture the imports are held against (tests/test_layout.py). The reading path is
the numbered list of files under "## The reading path" in docs/how-it-works.md: what a newcomer reads, in order, to
follow one sharded step from the trainer to a worker and back. Lines are physical lines of Python, as `wc -l` counts
them, in files `ruff format` leaves as they are (CI checks that), so no budget is met by packing lines.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("tinyconv", "backends", "transports")
BUDGETS = {  # lines, held by the tests: today's figures with a little room, lowered as the code gets shorter
    "Framework": 3295,
    "Door": 1027,
    "Dist": 7745,
    "Lab": 4826,
    "Backends": 2985,
    "Transports": 3133,
    "library outside the lab": 17158,  # the framework, the runtime, backends and transports (the door apart)
    "reading path": 1500,
    "reading path files": 8,
}
GOALS = {"library outside the lab": 13000, "reading path": 1500, "reading path files": 8}  # where the budgets head
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def library_files() -> list[Path]:
    """Every Python file of the library, as paths relative to the repository."""
    return sorted(p.relative_to(ROOT) for top in LIBRARY for p in (ROOT / top).rglob("*.py"))


def parts() -> dict[str, list[str]]:
    """Part name -> the files and folders (ending in /) docs/parts.json gives it."""
    picture = json.loads((ROOT / "docs/parts.json").read_text())
    return {name: part["is"] for name, part in picture["parts"].items()}


def part_of(path: Path, table: dict[str, list[str]]) -> str | None:
    """The part a file belongs to: the one naming it, or the folder nearest it."""
    best, depth = None, -1
    for name, places in table.items():
        for place in places:
            hit = str(path) == place or (place.endswith("/") and str(path).startswith(place))
            if hit and len(place) > depth:
                best, depth = name, len(place)
    return best


def reading_path() -> list[Path]:
    """The files listed, in order, under docs/how-it-works.md's "## The reading path"."""
    text = (ROOT / "docs/how-it-works.md").read_text()
    section = text.split("## The reading path", 1)[1].split("\n## ", 1)[0]
    return [Path(m) for m in re.findall(r"^\d+\. `([\w/.]+\.py)`", section, flags=re.M)]


def long_functions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``path`` over MAX_FUNCTION_LINES."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append((f"{path}:{node.lineno} {node.name}", n))
    return found


def measure() -> dict[str, int]:
    """Lines of each part, of the library outside the lab, and of the reading path (and its file count)."""
    table, totals = parts(), {}
    for path in library_files():
        part = part_of(path, table) or "on no part"
        totals[part] = totals.get(part, 0) + lines(ROOT / path)
    # as issue #36 counts it: framework, distribution, backends and transports; the lab and the door (the
    # commands a user types, the main job among them) are counted apart
    kept = ("Framework", "Dist", "Backends", "Transports")
    totals["library outside the lab"] = sum(n for part, n in totals.items() if part in kept)
    path = reading_path()
    totals["reading path"] = sum(lines(ROOT / p) for p in path)
    totals["reading path files"] = len(path)
    return totals


def over_limits() -> list[str]:
    """Every file over MAX_FILE_LINES and every function over MAX_FUNCTION_LINES, as lines to print."""
    out = []
    for path in library_files():
        if (n := lines(ROOT / path)) > MAX_FILE_LINES:
            out.append(f"{path}: {n} lines (a file's limit is {MAX_FILE_LINES})")
        out += [f"{name}: {n} lines (a function's limit is {MAX_FUNCTION_LINES})" for name, n in long_functions(path)]
    return out


def over_budget(totals: dict[str, int]) -> list[str]:
    return [f"{k}: {totals.get(k, 0)} over its budget of {v}" for k, v in BUDGETS.items() if totals.get(k, 0) > v]


def main(argv: list[str]) -> int:
    totals = measure()
    width = max(map(len, totals))
    for name, n in totals.items():
        budget, goal = BUDGETS.get(name), GOALS.get(name)
        print(
            f"{name:<{width}}  {n:>6}" + (f"  budget {budget}" if budget else "") + (f", goal {goal}" if goal else "")
        )
    print("\nreading path:", " -> ".join(str(p) for p in reading_path()))
    problems = over_budget(totals) + over_limits()
    for line in problems:
        print("OVER", line)
    return 1 if problems and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
