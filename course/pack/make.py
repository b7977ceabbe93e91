#!/usr/bin/env python3
"""``make course``: the student pack, its zip, and a zip for an autograding service.

    python course/pack/make.py                       # build/course-pack/, .zip, -autograder.zip
    python course/pack/make.py --lessons 1,2         # only lessons 1 and 2 (a week's hand-out)
    python course/pack/make.py --out DIR             # DIR/, DIR.zip, DIR-autograder.zip

The pack (``DIR/``, zipped into ``DIR.zip``) holds every lesson found in ``course/`` (``NN_name.py``)
as the student version (solutions replaced by stubs, ``course/build.py``) and as a notebook paired
with it by jupytext, ``charts.py``, the folders beside the lessons that they read (``data/``), the
graders (``graders/``), the points (``points.toml``), and ``grade.py``, which grades the student's
files and prints the points per exercise.

``DIR-autograder.zip`` is an autograder in Gradescope's format: ``setup.sh`` and ``run_autograder``
at its root, the graders, the points, ``grade.py``, and tinyconv's source (``library/``) for
``setup.sh`` to install.

Before writing the zips it checks that ``points.toml`` marks every collected grader test exactly once
and that no solution block of the full lessons appears in any file of the pack or its zips.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COURSE = HERE.parent
ROOT = COURSE.parent
sys.path.insert(0, str(HERE))

import autograder  # noqa: E402 -- this folder's modules
import leaks  # noqa: E402
import scoring  # noqa: E402

_spec = importlib.util.spec_from_file_location("course_build", COURSE / "build.py")
course_build = sys.modules.setdefault("course_build", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(course_build)

GRADER_FILES = ["conftest.py", "build.py", "charts.py"]  # from course/: what the graders import
GRADING = ["scoring.py", "submission.py"]  # from course/pack/: what grade.py imports
NOT_ASSETS = {"_build", "pack", "figures", "__pycache__"}  # course/'s folders that are not the lessons' data
PYTEST_INI = "[pytest]\n# the graders' own settings (none): pytest reads no project's settings above the pack\n"


class PackError(ValueError):
    """A pack that must not be handed out: the message says why."""


def choose(lessons: list[Path], only: str | None) -> list[Path]:
    """The lessons ``only`` names ("1,3" or "1 3"; None: all)."""
    if not only:
        return lessons
    wanted = {int(n) for n in only.replace(",", " ").split()}
    chosen = [p for p in lessons if int(p.name[:2]) in wanted]
    missing = wanted - {int(p.name[:2]) for p in chosen}
    if missing:
        raise PackError(f"no lesson {sorted(missing)} in {COURSE} (there are {[p.name for p in lessons]})")
    return chosen


def graders_of(lesson: Path) -> list[Path]:
    graders = sorted(COURSE.glob(f"test_lesson{int(lesson.name[:2])}_*.py"))
    if not graders:
        raise PackError(f"{lesson.name} has no grader (course/test_lesson{int(lesson.name[:2])}_*.py)")
    return graders


def graders_by_lesson(lessons: list[Path]) -> dict[str, list[Path]]:
    return {lesson.stem: graders_of(lesson) for lesson in lessons}


def assets(course: Path = COURSE) -> list[Path]:
    """The folders beside the lessons that they read (course/data/: the images that ship with the course)."""
    return sorted(p for p in course.iterdir() if p.is_dir() and p.name not in NOT_ASSETS and not p.name.startswith("."))


def fresh(out: Path) -> None:
    """Empty ``out`` if it is a pack built before; refuse to empty anything else."""
    if out.exists() and any(out.iterdir()) and not (out / "grade.py").is_file():
        raise PackError(f"{out} exists and is not a pack built before: give another --out")
    shutil.rmtree(out, ignore_errors=True)
    (out / "graders").mkdir(parents=True)


def title(lesson: Path) -> str:
    first = course_build.parse_cells(lesson.read_text(), lesson.name)[0].source.splitlines()[0]
    return first.lstrip("# ").strip()


def readme(lessons: list[Path], exercises: dict[str, list[scoring.Exercise]]) -> str:
    """The pack's README: course/pack/README.md, then the lessons in this pack and their points."""
    rows = ["| file | lesson | exercises (points) |", "| --- | --- | --- |"]
    for lesson in lessons:
        marks = ", ".join(f"`{e.name}` ({scoring.fmt(e.points)})" for e in exercises[lesson.stem])
        rows.append(f"| `{lesson.name}` | {title(lesson)} | {marks} |")
    total = scoring.fmt(sum(e.points for es in exercises.values() for e in es))
    table = "\n".join(rows)
    return (HERE / "README.md").read_text() + f"\n## In this pack\n\n{table}\n\nIn all: {total} points.\n"


def write_pack(out: Path, lessons: list[Path]) -> None:
    """The pack's folder, emptied before (``fresh``): stubs and notebooks, charts.py, data, grade.py, points,
    README and graders/."""
    for lesson in lessons:
        stub = course_build.student_text(lesson.read_text(), lesson.name)
        (out / lesson.name).write_text(stub)
        nb = course_build.notebook(course_build.parse_cells(stub, lesson.name))
        (out / lesson.with_suffix(".ipynb").name).write_text(json.dumps(nb, indent=1) + "\n")
        for grader in graders_of(lesson):
            shutil.copyfile(grader, out / "graders" / grader.name)
    for name in GRADER_FILES:
        shutil.copyfile(COURSE / name, out / "graders" / name)
    for name in GRADING:
        shutil.copyfile(HERE / name, out / "graders" / name)
    (out / "graders" / "pytest.ini").write_text(PYTEST_INI)
    for folder in assets():  # beside the lessons, where they look for it
        shutil.copytree(folder, out / folder.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copyfile(COURSE / "charts.py", out / "charts.py")
    shutil.copyfile(HERE / "grade.py", out / "grade.py")
    shutil.copyfile(COURSE / "points.toml", out / "points.toml")
    exercises = scoring.load_points(COURSE / "points.toml", graders_by_lesson(lessons))
    (out / "README.md").write_text(readme(lessons, exercises))


def collected(pack: Path) -> dict[str, list[str]]:
    """{lesson: its grader tests ("name[id]")}, as pytest collects them in the pack."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "graders"]
    run = subprocess.run([*cmd, "--student-dir", "."], capture_output=True, text=True, cwd=pack, timeout=300)
    if run.returncode != 0:
        raise PackError(f"the graders do not collect (pytest's exit status {run.returncode}):\n{run.stdout[-3000:]}")
    tests: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():
        file, sep, test = line.partition("::")
        if sep:
            tests.setdefault(scoring.lesson_of(pack / "graders" / Path(file).name), []).append(test)
    return tests


def check(pack: Path, lessons: list[Path]) -> None:
    """points.toml against the graders' tests as collected in ``pack``: each marked by exactly one exercise."""
    graders = graders_by_lesson(lessons)
    exercises = scoring.load_points(pack / "points.toml", graders)
    tests = collected(pack)
    problems = [p for lesson in graders for p in scoring.check(exercises[lesson], tests.get(lesson, []))]
    listed = scoring.tomllib.loads((pack / "points.toml").read_text())
    for lesson in (lesson for lesson in graders if lesson not in listed):
        print(f"note: course/points.toml has no [{lesson}]: a point per grader test function", file=sys.stderr)
    if problems:
        raise PackError("course/points.toml does not fit the graders:\n  " + "\n  ".join(problems))


def check_no_solution(paths: list[Path]) -> None:
    full = course_build.lessons(COURSE)
    blocks = [b for lesson in full for b in leaks.solution_blocks(lesson.read_text(), lesson.name)]
    found = leaks.leaks(blocks, paths)
    if found:
        raise PackError("a solution is in the pack:\n  " + "\n  ".join(found))


def build(out: Path, only: str | None = None) -> list[Path]:
    """Write the pack ``out/``, ``out.zip`` and ``out-autograder.zip``; returns the two zips."""
    out = out.resolve()
    lessons = choose(course_build.lessons(COURSE), only)
    if not lessons:
        raise PackError(f"no lessons (NN_name.py) in {COURSE}")
    student_zip, grader_zip = out.parent / f"{out.name}.zip", out.parent / f"{out.name}-autograder.zip"
    fresh(out)  # refuses a folder that is not a pack: nothing below removes what it did not write
    try:
        write_pack(out, lessons)
        check(out, lessons)
        check_no_solution([out])
        autograder.zip_tree(out, student_zip, prefix=out.name)
        autograder.write(out, grader_zip, ROOT)
        check_no_solution([student_zip, grader_zip])
    except PackError:  # nothing half-built or leaky is left to hand out by mistake
        shutil.rmtree(out, ignore_errors=True)
        student_zip.unlink(missing_ok=True)
        grader_zip.unlink(missing_ok=True)
        raise
    return [student_zip, grader_zip]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python course/pack/make.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "course-pack", help="default build/course-pack")
    parser.add_argument("--lessons", help='the lessons to hand out, "1,2" (default all)')
    args = parser.parse_args(argv)
    try:
        zips = build(args.out, args.lessons)
    except (PackError, course_build.LessonError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    files = sorted(p.relative_to(args.out.resolve()) for p in args.out.resolve().rglob("*") if p.is_file())
    print(f"{args.out}/: the student pack, {len(files)} files:\n  " + "\n  ".join(map(str, files)))
    exercises = scoring.load_points(
        COURSE / "points.toml", graders_by_lesson(choose(course_build.lessons(COURSE), args.lessons))
    )
    total = sum(e.points for es in exercises.values() for e in es)
    print(f"points: {scoring.fmt(total)} in all (course/points.toml; the pack's README has them per exercise)")
    print(f"{zips[0]}: the same, zipped, to hand out")
    print(f"{zips[1]}: the autograder (Gradescope's format: setup.sh, run_autograder at its root)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
