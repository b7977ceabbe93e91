#!/usr/bin/env python3
"""Grade a student's lessons: the graders run on their files, and a table says what each exercise earned.

    python grade.py                        # the lessons in this folder (the student pack)
    python grade.py 1 3                    # lessons 1 and 3 only
    python grade.py --student-dir ~/alice  # someone else's files (NN_name.py or NN_name.ipynb)
    python grade.py --results results.json # also write an autograder's results.json (Gradescope's format)

In the student pack this file sits beside the lessons, with the graders in ``graders/`` and the
points in ``points.toml``. In the repository (``course/pack/grade.py``) it grades with the graders
and points of ``course/``, by default the teacher's own solutions there.

Each lesson's graders run in their own pytest process, with a time limit, so that one lesson that
hangs or crashes costs that lesson only. The exit status is 0 for full marks, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ left in the student's pack
HERE = Path(__file__).resolve().parent
IN_PACK = (HERE / "graders").is_dir()
ROOT = HERE if IN_PACK else HERE.parent  # the pack, or course/ in the repository
GRADERS = ROOT / "graders" if IN_PACK else ROOT
sys.path.insert(0, str(GRADERS if (GRADERS / "scoring.py").is_file() else HERE))

import scoring  # noqa: E402 -- beside the graders in the pack, beside this file in the repository
import submission  # noqa: E402


def find_graders(folder: Path, only: list[str]) -> dict[str, list[Path]]:
    """{lesson stem: its grader files} for the graders in ``folder``, those of the lessons ``only`` names
    (numbers, "3", or stems) if any."""
    graders: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("test_lesson*.py")):
        graders.setdefault(scoring.lesson_of(path), []).append(path)
    if only:
        wanted = {f"{int(o):02d}" if o.isdigit() else o for o in only}
        graders = {k: v for k, v in graders.items() if k in wanted or k[:2] in wanted}
    return dict(sorted(graders.items()))  # by lesson: test_lesson10_* sorts before test_lesson1_* by name


def run_graders(files: list[Path], student_dir: Path, timeout: float) -> tuple[list[scoring.Outcome], str]:
    """Run pytest on ``files`` against ``student_dir``; the outcomes, and what went wrong if it did not finish."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider"]
        cmd += ["--student-dir", str(student_dir), f"--junitxml={report}"]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,  # an input() left in an answer fails instead of waiting
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and whatever the student's code started
            else:
                proc.kill()
            proc.communicate()
            return [], f"the graders ran past {timeout:g} s and were stopped"
        tail = " ".join(out.strip().splitlines()[-3:])[-600:]
        if not report.is_file():
            return [], f"the graders stopped without a report (pytest's exit status {proc.returncode}): {tail}"
        return scoring.read_junit(report), "" if proc.returncode in (0, 1) else tail


def grade_lesson(exercises: list[scoring.Exercise], files: list[Path], staged: Path, timeout: float):
    """The scores of one lesson's exercises; a collection error becomes the note of those no test reached."""
    outcomes, note = run_graders(files, staged, timeout)
    scores, stray = scoring.score(exercises, outcomes, note)
    for o in stray:  # a grader that could not be collected, or a test points.toml does not name
        collecting = o.message.startswith("collection failure")
        if not collecting:
            print(f"warning: {o.test} is marked by no exercise in points.toml: it earns nothing", file=sys.stderr)
        why = next((line.strip() for line in reversed(o.message.splitlines()) if line.strip()), "")
        for s in scores:
            if not s.outcomes and (collecting or not s.note):
                s.note = why
    return scores


def grade(graders: dict[str, list[Path]], student_dir: Path, points: Path, timeout: float):
    """The scores of every exercise of the lessons in ``graders``, and a line per lesson on what was graded."""
    exercises = scoring.load_points(points, graders)
    scores, said = [], []
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "submission"
        sources = submission.stage(student_dir, list(graders), staged)
        for lesson, files in graders.items():
            src = sources[lesson]
            said.append(f"{lesson}: " + (f"graded {src.relative_to(student_dir)}" if src else "not handed in"))
            scores += grade_lesson(exercises[lesson], files, staged, timeout)
    return scores, said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python grade.py", description="Grade lessons: points per exercise.")
    parser.add_argument("lessons", nargs="*", help="lesson numbers (or NN_name stems) to grade; default all")
    default_dir = "this folder" if IN_PACK else "course/, the teacher's solutions"
    parser.add_argument("--student-dir", type=Path, default=ROOT, help=f"the student's files (default {default_dir})")
    parser.add_argument("--points", type=Path, default=ROOT / "points.toml", help="points per exercise")
    parser.add_argument("--graders", type=Path, default=GRADERS, help="the folder of the graders (test_lessonN_*.py)")
    parser.add_argument("--results", type=Path, help="also write the scores as an autograder's results.json")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one lesson's graders may take (600)")
    args = parser.parse_args(argv)
    graders = find_graders(args.graders, args.lessons)
    if not graders:
        parser.error(f"no graders (test_lessonN_*.py) for {args.lessons or 'any lesson'} in {args.graders}")
    if not args.student_dir.is_dir():
        parser.error(f"--student-dir {args.student_dir} is not a folder")
    scores, said = grade(graders, args.student_dir.resolve(), args.points, args.timeout)
    print("\n".join(said), end="\n\n")
    print(scoring.table(scores))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(scoring.results_json(scores, "\n".join(said)), indent=1) + "\n")
    return 0 if all(s.earned == s.exercise.points for s in scores) else 1


if __name__ == "__main__":
    sys.exit(main())
