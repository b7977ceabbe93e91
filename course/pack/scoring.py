"""Points per exercise: which grader tests mark an exercise, and what one run of them earned.

``points.toml`` has a table per lesson (its file's stem) and in it an entry per exercise: its
``points`` and the grader ``tests`` that mark it, each a test function's name, or a name with a
glob over its parameters' id in brackets (``test_convolution_equals_the_reference[conv2d_loops-*]``).
A lesson with no table gets one exercise per grader test function, worth 1 point.

An exercise earns ``points * (its tests passed) / (its tests)``, rounded to 0.01, and nothing while
a stub is left in it (one of its tests failed on ``NotImplementedError``): a stub that happens to
pass one check is no answer. Skipped tests count as not passed.

Standard library only (and tomli on Python 3.10, a dependency of tinyconv there): the student pack
and the autograder run this beside the graders.
"""

from __future__ import annotations

import ast
import fnmatch
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

STUB = "NotImplementedError"


def matches(pattern: str, test: str) -> bool:
    """Whether ``test`` ("name[id]") is one ``pattern`` names: the same function, its id glob-matched."""
    name, _, ids = pattern.partition("[")
    test_name, _, test_ids = test.partition("[")
    if name != test_name:
        return False
    return not ids or fnmatch.fnmatchcase(test_ids.removesuffix("]"), ids.removesuffix("]"))


@dataclass(frozen=True)
class Exercise:
    """One exercise of a lesson, its points and the grader tests (patterns) that mark it."""

    lesson: str
    name: str
    points: float
    tests: tuple[str, ...]

    def marks(self, test: str) -> bool:
        return any(matches(p, test) for p in self.tests)


@dataclass(frozen=True)
class Outcome:
    """One grader test's result: its name ("test_x[id]"), passed or not, and why not."""

    test: str
    passed: bool
    message: str = ""


@dataclass
class Score:
    """What an exercise earned from the outcomes of its tests; ``note`` says why none ran, if none did."""

    exercise: Exercise
    outcomes: list[Outcome] = field(default_factory=list)
    note: str = ""

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    @property
    def stubbed(self) -> bool:
        return any(STUB in o.message.split("\n", 1)[0] for o in self.outcomes if not o.passed)  # what was raised

    @property
    def earned(self) -> float:
        if not self.outcomes or self.stubbed:
            return 0.0
        return round(self.exercise.points * self.passed / len(self.outcomes), 2)

    def output(self, limit: int = 400) -> str:
        """What a student reads: tests passed, and the first line of each distinct failure."""
        if not self.outcomes:
            return f"no grader test ran for it: {self.note}" if self.note else "no grader test ran for it"
        stub = " (a stub is left in it: it earns nothing yet)" if self.stubbed else ""
        lines = [f"{self.passed}/{len(self.outcomes)} tests passed{stub}"]
        seen: set[str] = set()
        for o in self.outcomes:
            why = (o.message.strip().splitlines() or ["failed"])[0][:limit]
            if not o.passed and why not in seen:
                seen.add(why)
                lines.append(f"{o.test}: {why}")
        return "\n".join(lines)


def lesson_of(grader: Path) -> str:
    """The lesson a grader grades: its module-level ``LESSON = "NN_name"``."""
    for node in ast.parse(grader.read_text(), str(grader)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LESSON" for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    raise ValueError(f"{grader}: no LESSON = 'NN_name' at its top level")


def test_functions(grader: Path) -> list[str]:
    """The grader's test functions, in file order."""
    tree = ast.parse(grader.read_text(), str(grader))
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]


def load_points(path: Path, graders: dict[str, list[Path]]) -> dict[str, list[Exercise]]:
    """The exercises of every lesson in ``graders`` ({lesson: its grader files}), from ``path`` or the fallback."""
    table = tomllib.loads(path.read_text()) if path.is_file() else {}
    out: dict[str, list[Exercise]] = {}
    for lesson, files in graders.items():
        entries = table.get(lesson)
        if entries is None:  # not in points.toml: a point per test function
            names = [t for f in files for t in test_functions(f)]
            out[lesson] = [Exercise(lesson, n.removeprefix("test_"), 1, (n,)) for n in names]
            continue
        out[lesson] = []
        for name, entry in entries.items():
            points = entry.get("points") if isinstance(entry, dict) else None
            if not isinstance(points, (int, float)) or not entry.get("tests"):
                raise ValueError(f"{path}: [{lesson}] {name} needs points = N and tests = [...]")
            out[lesson].append(Exercise(lesson, name, entry["points"], tuple(entry["tests"])))
    return out


def check(exercises: list[Exercise], tests: list[str]) -> list[str]:
    """What is wrong with a lesson's exercises against its collected tests: a test no exercise (or two)
    marks, an exercise that marks no test, points not above 0."""
    problems = []
    for test in tests:
        owners = [e.name for e in exercises if e.marks(test)]
        if len(owners) != 1:
            problems.append(f"{test} is marked by {len(owners)} exercises {owners}, not 1")
    for e in exercises:
        if e.points <= 0:
            problems.append(f"{e.name}: points must be above 0, not {e.points}")
        for pattern in e.tests:
            if not any(matches(pattern, t) for t in tests):
                problems.append(f"{e.name}: its test {pattern!r} names no grader test")
    return [f"{exercises[0].lesson if exercises else '?'}: {p}" for p in problems]


def score(exercises: list[Exercise], outcomes: list[Outcome], note: str = "") -> tuple[list[Score], list[Outcome]]:
    """Each outcome to the first exercise that marks it; returns the scores and the outcomes none marks."""
    scores = [Score(e, note=note) for e in exercises]
    stray = []
    for o in outcomes:
        owner = next((s for s in scores if s.exercise.marks(o.test)), None)
        if owner is None:
            stray.append(o)
        else:
            owner.outcomes.append(o)
    return scores, stray


def read_junit(path: Path) -> list[Outcome]:
    """The outcomes in a pytest JUnit XML report."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
        skipped = case.find("skipped")
        if bad is not None:
            outcomes.append(Outcome(case.get("name", ""), False, (bad.get("message") or "") + "\n" + (bad.text or "")))
        elif skipped is not None:
            outcomes.append(Outcome(case.get("name", ""), False, "skipped: " + (skipped.get("message") or "")))
        else:
            outcomes.append(Outcome(case.get("name", ""), True))
    return outcomes


def fmt(x: float) -> str:
    return f"{round(x, 2):g}"


def table(scores: list[Score]) -> str:
    """The per-exercise table and the total, as printed by ``grade``."""
    rows = [("lesson", "exercise", "tests", "points")]
    for s in scores:
        tests = f"{s.passed}/{len(s.outcomes)}" + (" stub" if s.stubbed else "") if s.outcomes else "none ran"
        rows.append((s.exercise.lesson, s.exercise.name, tests, f"{fmt(s.earned)} / {fmt(s.exercise.points)}"))
    earned, possible = sum(s.earned for s in scores), sum(s.exercise.points for s in scores)
    rows.append(("total", "", "", f"{fmt(earned)} / {fmt(possible)}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    pad = widths[:3]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r[:3], pad, strict=True)), r[3].rjust(widths[3])]) for r in rows]
    rule = "-" * len(lines[0])
    return "\n".join([lines[0], rule, *lines[1:-1], rule, lines[-1]])


def results_json(scores: list[Score], output: str = "") -> dict:
    """Gradescope's results.json: the score and, per exercise, its score, max_score and output."""
    tests = [
        {
            "name": f"{s.exercise.lesson}: {s.exercise.name}",
            "score": s.earned,
            "max_score": s.exercise.points,
            "output": s.output(),
        }
        for s in scores
    ]
    return {"score": round(sum(s.earned for s in scores), 2), "output": output, "tests": tests}
