"""The graders' plumbing: ``pytest course/ --student-dir DIR`` grades the lessons in DIR.

Without ``--student-dir`` the graders grade the teacher's own solutions (course/NN_name.py).
A grader does not run a whole lesson: it executes the lesson's cells tagged ``setup`` (imports)
and ``exercise`` (the functions to write) into a fresh module, and checks those functions
against tinyconv's own reference on fixed seeds. So an unfinished exercise fails its own
tests only, and a lesson's long demos never run while grading.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("course_build", HERE / "build.py")
course_build = sys.modules["course_build"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(course_build)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--student-dir",
        default=None,
        help="a folder with the student's lesson files (NN_name.py, as handed out); default: grade the "
        "teacher's solutions in course/",
    )


def load_exercises(path: Path) -> types.ModuleType:
    """The setup and exercise cells of the lesson at ``path``, executed as a module."""
    if not path.is_file():
        pytest.fail(f"no lesson file {path}: --student-dir must hold the lesson files by their handed-out names")
    cells = [c for c in course_build.parse_cells(path.read_text(), path.name) if c.kind == "code"]
    chosen = [c for c in cells if {"setup", "exercise"} & set(c.tags)]
    if not any("exercise" in c.tags for c in chosen):
        pytest.fail(f'{path.name} has no cell tagged exercise (# %% tags=["exercise"]); was the tag removed?')
    module = types.ModuleType(f"lesson_{path.stem}")
    module.__file__ = str(path)
    for c in chosen:
        exec(compile(c.code(), str(path), "exec"), module.__dict__)  # noqa: S102 -- the student's own code
    return module


@pytest.fixture(scope="module")
def lesson(request: pytest.FixtureRequest) -> types.ModuleType:
    """The lesson a grader module names in its ``LESSON`` ("01_convolution_by_hand"), from --student-dir or course/."""
    folder = request.config.getoption("--student-dir")
    folder = Path(folder).resolve() if folder else HERE
    return load_exercises(folder / f"{request.module.LESSON}.py")
