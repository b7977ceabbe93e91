"""The student pack (``make course``, course/pack/): what it holds, that no solution is in it, that its
``grade.py`` gives the stubs 0 and the full lessons full marks, per exercise, and that its autograder
zip, run offline with its paths moved, writes Gradescope's results.json.

Each grading runs as a lecturer or Gradescope would run it: ``python grade.py`` or ``bash
run_autograder`` in a subprocess, on the pack built into a temporary folder."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COURSE = ROOT / "course"
_spec = importlib.util.spec_from_file_location("course_pack_make", COURSE / "pack" / "make.py")
make = sys.modules.setdefault("course_pack_make", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(make)
build, scoring, leaks = make.course_build, make.scoring, make.leaks
submission = importlib.import_module("submission")  # course/pack/, on the path make.py set

LESSONS = build.lessons(COURSE)


def has_opencl() -> bool:
    try:
        from backends.opencl.device import select_device

        select_device()
        return True
    except Exception:  # noqa: BLE001 -- no pyopencl, no platform, no device: all mean "no"
        return False


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("built") / "course-pack"
    assert make.build(out) == [out.parent / "course-pack.zip", out.parent / "course-pack-autograder.zip"]
    return out


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def grade(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, env=env(), cwd=script.parent
    )


def points() -> dict[str, list]:
    graders = {p.stem: sorted(COURSE.glob(f"test_lesson{int(p.name[:2])}_*.py")) for p in LESSONS}
    return scoring.load_points(COURSE / "points.toml", graders)


def test_the_pack_holds_the_stubs_their_notebooks_the_graders_and_grade(pack):
    names = {p.relative_to(pack).as_posix() for p in pack.rglob("*") if p.is_file()}
    want = {"README.md", "charts.py", "grade.py", "points.toml", "graders/pytest.ini"}
    want |= {f"graders/{n}" for n in ("conftest.py", "build.py", "charts.py", "scoring.py", "submission.py")}
    for folder in (d for d in COURSE.iterdir() if d.is_dir() and d.name not in ("_build", "pack", "__pycache__")):
        if not folder.name.startswith("."):  # data the lessons read beside them (course/data/)
            want |= {f.relative_to(COURSE).as_posix() for f in folder.rglob("*") if f.is_file()}
    for lesson in LESSONS:
        want |= {lesson.name, lesson.with_suffix(".ipynb").name}
        want |= {f"graders/{g.name}" for g in COURSE.glob(f"test_lesson{int(lesson.name[:2])}_*.py")}
    assert names == want
    with zipfile.ZipFile(pack.parent / "course-pack.zip") as z:
        assert set(z.namelist()) == {f"course-pack/{n}" for n in names}
    with zipfile.ZipFile(pack.parent / "course-pack-autograder.zip") as z:
        members = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    assert members["setup.sh"] & 0o111 and members["run_autograder"] & 0o111  # at the root, executable
    assert {"grade.py", "points.toml", "library/pyproject.toml", "library/tinyconv/__init__.py"} <= set(members)
    assert {f"graders/{n.removeprefix('graders/')}" for n in names if n.startswith("graders/")} <= set(members)
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_each_stub_raises_and_its_notebook_is_paired_with_it(pack, lesson):
    stub = (pack / lesson.name).read_text()
    assert build.BEGIN not in stub and build.END not in stub
    assert stub.count("raise NotImplementedError(") == lesson.read_text().count(build.BEGIN) > 0
    nb = json.loads((pack / lesson.with_suffix(".ipynb").name).read_text())
    assert nb["nbformat"] == 4 and nb["metadata"]["jupytext"] == {"formats": "ipynb,py:percent"}
    cells = build.parse_cells(stub, lesson.name)
    assert ["".join(c["source"]) for c in nb["cells"]] == [c.source for c in cells]
    back = build.parse_cells(submission.percent_from_notebook(nb), lesson.name)  # what grade.py reads of it
    assert [(c.kind, c.tags, c.source) for c in back] == [(c.kind, c.tags, c.source) for c in cells]


def test_no_solution_is_anywhere_in_the_pack_or_its_zips(pack, tmp_path):
    blocks = [b for lesson in LESSONS for b in leaks.solution_blocks(lesson.read_text(), lesson.name)]
    assert len(blocks) == sum(p.read_text().count(build.BEGIN) for p in LESSONS)
    shipped = [pack, pack.parent / "course-pack.zip", pack.parent / "course-pack-autograder.zip"]
    assert leaks.leaks(blocks, shipped) == []
    # the check finds a solution wherever it hides: a lesson, its notebook (JSON), a zip of them
    full, files = LESSONS[0], tmp_path / "files"
    files.mkdir()
    (files / full.name).write_text(full.read_text().replace("\n    ", "\n        "))
    nb = build.notebook(build.parse_cells(full.read_text(), full.name))
    (files / "teacher.ipynb").write_text(json.dumps(nb))
    make.autograder.zip_tree(files, tmp_path / "leaky.zip")
    found = leaks.leaks(blocks, [tmp_path])
    expected = len([b for b in blocks if b.where.startswith(full.name)])
    assert len(found) == 4 * expected > 0, found  # the file, the notebook, and both in the zip
    with pytest.raises(make.PackError, match="a solution is in the pack"):
        make.check_no_solution([tmp_path / "leaky.zip"])


def test_grade_gives_the_stubs_nothing_per_exercise(pack):
    run = grade(pack / "grade.py", "--results", str(pack.parent / "stub.json"))
    assert run.returncode == 1, run.stdout + run.stderr
    results = json.loads((pack.parent / "stub.json").read_text())
    exercises = [e for es in points().values() for e in es]
    assert results["score"] == 0
    assert [(t["name"], t["score"], t["max_score"]) for t in results["tests"]] == [
        (f"{e.lesson}: {e.name}", 0, e.points) for e in exercises
    ]
    opencl = has_opencl()
    for t in results["tests"]:
        if opencl or not t["name"].startswith("04"):
            assert "NotImplementedError" in t["output"], t
    total = scoring.fmt(sum(e.points for e in exercises))
    assert run.stdout.splitlines()[-1].split() == ["total", "0", "/", total]
    for e in exercises:
        assert any(line.split()[:2] == [e.lesson, e.name] for line in run.stdout.splitlines()), e


def test_grade_gives_the_full_lessons_full_marks(pack):
    lessons = [p.name[:2] for p in LESSONS if has_opencl() or not p.name.startswith("04")]
    run = grade(pack / "grade.py", *lessons, "--student-dir", str(COURSE), "--results", str(pack.parent / "full.json"))
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((pack.parent / "full.json").read_text())
    assert results["tests"] and all(t["score"] == t["max_score"] for t in results["tests"]), results
    assert results["score"] == sum(e.points for lesson, es in points().items() if lesson[:2] in lessons for e in es)


def test_grade_gives_partial_marks_and_reads_a_notebook(pack, tmp_path):
    """Lesson 6 handed in as a notebook with two of its three exercises done; lesson 2 not handed in."""
    full = (COURSE / "06_zeromq_workers.py").read_text()
    cut = full.index("def imbalance(")
    partial = full[:cut] + build.student_text(full[cut:])  # only imbalance left a stub
    nb = build.notebook(build.parse_cells(partial, "06_zeromq_workers.py"))
    (tmp_path / "06_zeromq_workers.ipynb").write_text(json.dumps(nb))
    run = grade(pack / "grade.py", "2", "6", "--student-dir", str(tmp_path), "--results", str(tmp_path / "r.json"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "06_zeromq_workers: graded 06_zeromq_workers.ipynb" in run.stdout
    assert "02_backprop: not handed in" in run.stdout
    got = {t["name"]: t["score"] for t in json.loads((tmp_path / "r.json").read_text())["tests"]}
    want = {f"{e.lesson}: {e.name}": e.points for e in points()["06_zeromq_workers"]}
    assert want["06_zeromq_workers: imbalance"] > 0
    want["06_zeromq_workers: imbalance"] = 0
    want |= {f"02_backprop: {e.name}": 0 for e in points()["02_backprop"]}
    assert got == want


def run_autograder(source: Path, root: Path, files: list[Path]) -> dict:
    (root / "submission").mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, root / "submission" / f.name)
    shutil.copytree(source, root / "source")
    run = subprocess.run(
        ["bash", str(root / "source" / "run_autograder")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env(), "AUTOGRADER_ROOT": str(root), "PYTHON": sys.executable},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads((root / "results" / "results.json").read_text())


def test_the_autograder_zip_scores_a_stub_0_and_the_solutions_full_marks(tmp_path):
    """Built for lessons 2 and 6 (a week's hand-out), unpacked where /autograder would be, run offline."""
    out = tmp_path / "pack"
    make.build(out, "2,6")
    with zipfile.ZipFile(tmp_path / "pack-autograder.zip") as z:
        z.extractall(tmp_path / "unzipped")
    chosen = [p for p in LESSONS if p.name[:2] in ("02", "06")]
    stub = run_autograder(tmp_path / "unzipped", tmp_path / "stub", [out / p.name for p in chosen])
    full = run_autograder(tmp_path / "unzipped", tmp_path / "full", chosen)
    assert stub["score"] == 0 and all(t["score"] == 0 for t in stub["tests"])
    maximum = sum(t["max_score"] for t in full["tests"])
    assert full["score"] == maximum == sum(e.points for lesson in ("02", "06") for e in points()[chosen_stem(lesson)])
    for t in stub["tests"] + full["tests"]:
        assert set(t) == {"name", "score", "max_score", "output"} and t["output"], t


def chosen_stem(number: str) -> str:
    return next(p.stem for p in LESSONS if p.name.startswith(number))


def test_points_must_mark_every_grader_test_once(pack, tmp_path):
    ex = [scoring.Exercise("l", "a", 2, ("test_x[a-*]", "test_gone")), scoring.Exercise("l", "b", 0, ("test_x",))]
    problems = "\n".join(scoring.check(ex, ["test_x[a-1]", "test_x[b-1]", "test_y"]))
    assert "test_x[a-1] is marked by 2 exercises" in problems and "test_y is marked by 0" in problems
    assert "'test_gone' names no grader test" in problems and "b: points must be above 0" in problems
    assert not scoring.check(ex[:1], ["test_x[a-1]", "test_gone"])
    assert scoring.matches("test_x", "test_x[1]") and not scoring.matches("test_x", "test_x_y")
    broken = tmp_path / "pack"
    shutil.copytree(pack, broken)
    text = (broken / "points.toml").read_text().replace('"test_im2col_equals_tinyconvs"', '"test_im2col_renamed"')
    (broken / "points.toml").write_text(text)
    with pytest.raises(make.PackError, match="test_im2col_renamed' names no grader test"):
        make.check(broken, LESSONS)
    # a lesson points.toml does not know: one point per grader test function
    graders = {"06_zeromq_workers": sorted(COURSE.glob("test_lesson6_*.py"))}
    got = scoring.load_points(tmp_path / "none.toml", graders)["06_zeromq_workers"]
    assert [(e.name, e.points, e.tests) for e in got[:2]] == [
        ("split_fractions", 1, ("test_split_fractions",)),
        ("split_fractions_alone", 1, ("test_split_fractions_alone",)),
    ]


def test_make_refuses_to_replace_a_folder_that_is_not_a_pack(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(make.PackError, match="not a pack built before"):
        make.build(tmp_path, "2")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_grade_takes_the_newer_of_the_script_and_the_notebook(tmp_path):
    py, nb = tmp_path / "01_x.py", tmp_path / "sub" / "01_x.ipynb"
    nb.parent.mkdir()
    py.write_text("# %%\n")
    nb.write_text("{}")
    os.utime(py, (1_000_000, 1_000_000))
    os.utime(nb, (2_000_000, 2_000_000))
    assert submission.find(tmp_path, "01_x") == py  # in the folder itself: a subfolder is searched only without it
    (tmp_path / "01_x.ipynb").write_text("{}")
    os.utime(tmp_path / "01_x.ipynb", (2_000_000, 2_000_000))
    assert submission.find(tmp_path, "01_x") == tmp_path / "01_x.ipynb"
    os.utime(py, (2_000_000, 2_000_000))
    assert submission.find(tmp_path, "01_x") == py  # a tie: the script
    assert submission.find(tmp_path, "02_y") is None


def test_make_course_builds_the_pack():
    out = subprocess.run(["make", "-n", "course"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "course/pack/make.py --out build/course-pack" in out.stdout, out.stdout + out.stderr
