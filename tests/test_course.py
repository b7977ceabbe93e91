"""The course (course/): every lesson runs headless on tiny shapes and the generator writes valid notebooks.
(That the graders pass the teacher's solutions and fail the generated student version is held where a
lecturer runs them, the pack's grade.py: tests/test_course_pack.py.)

The lessons run as a student would run them, ``python course/NN_name.py``, with ``COURSE_QUICK=1``
(tiny shapes) and their charts written to a temporary folder.

The real images lessons 1 and 3 use without the real CIFAR-10 ship as course/data/cifar10_sample.npz.xz:
:func:`make_sample` is its recipe, and with the real set on this machine (``$TINYCONV_DATA``) a test holds the
file to it."""

from __future__ import annotations

import importlib.util
import io
import json
import lzma
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from tinyconv.cifar10 import IMAGE_SHAPE, LABEL_NAMES, default_data_dir, find_batches_dir, load_batch

ROOT = Path(__file__).resolve().parent.parent
COURSE = ROOT / "course"
_spec = importlib.util.spec_from_file_location("course_build", COURSE / "build.py")
build = sys.modules.setdefault("course_build", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(build)
LESSONS = build.lessons(COURSE)
SAMPLE = COURSE / "data" / "cifar10_sample.npz.xz"
SAMPLE_BYTES = 100_000  # what a repository can carry without anyone noticing
PER_CLASS = (20, 10)  # training images of each class (from data_batch_1), test images (from test_batch)
PICTURES = (13, 1, 11, 23)  # test images kept whole for lesson 1: a horse, a ship, a truck, a fire engine


def make_sample(batches: Path) -> dict[str, np.ndarray]:
    """The course's sample of CIFAR-10, from the real set's batches folder: the first 20 training images of
    each class and the first 10 test images of each class, halved to 16x16 (each pixel the mean of a 2x2
    block) with each colour rounded to 16 levels (v // 16 * 16 + 8: 300 such images take 80 KB, whole ones
    would take 690 KB), and 4 test images whole (3x32x32, every bit) for lesson 1's pictures."""
    x_train, y_train = load_batch(batches / "data_batch_1")
    x_test, y_test = load_batch(batches / "test_batch")

    def first(labels: np.ndarray, per_class: int) -> np.ndarray:
        return np.sort(np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in range(len(LABEL_NAMES))]))

    def small(rows: np.ndarray) -> np.ndarray:
        halved = rows.reshape(-1, 3, 16, 2, 16, 2).mean(axis=(3, 5))
        return (np.floor(halved / 16) * 16 + 8).astype(np.uint8)

    train, test, pictures = first(y_train, PER_CLASS[0]), first(y_test, PER_CLASS[1]), np.array(PICTURES)
    return {
        "x_train": small(x_train[train]),
        "y_train": y_train[train].astype(np.uint8),
        "x_test": small(x_test[test]),
        "y_test": y_test[test].astype(np.uint8),
        "pictures": x_test[pictures].reshape(-1, *IMAGE_SHAPE),
        "picture_index": pictures,
        "picture_labels": y_test[pictures].astype(np.uint8),
        "classes": np.array(LABEL_NAMES),
    }


def write_sample(arrays: dict[str, np.ndarray], path: Path = SAMPLE) -> int:
    """An .npz (uncompressed) of ``arrays``, compressed whole with xz, at ``path``; its size in bytes."""
    npz = io.BytesIO()
    np.savez(npz, **arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.write_bytes(lzma.compress(npz.getvalue(), preset=9 | lzma.PRESET_EXTREME))


def read_sample(path: Path = SAMPLE) -> dict[str, np.ndarray]:
    """The arrays of the course's sample, as lessons 1 and 3 read them."""
    with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as npz:
        return dict(npz)


def env(tmp_path: Path) -> dict[str, str]:
    quick = {"COURSE_QUICK": "1", "COURSE_FIGURES": str(tmp_path / "figures")}
    return {**os.environ, **quick, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def has_opencl() -> bool:
    try:
        from backends.opencl.device import select_device

        select_device()
        return True
    except Exception:  # noqa: BLE001 -- no pyopencl, no platform, no device: all mean "no"
        return False


def test_there_are_ten_lessons_each_with_exercises():
    assert [p.name[:2] for p in LESSONS] == [f"{i:02d}" for i in range(1, 11)]
    for path in LESSONS:
        cells = build.parse_cells(path.read_text(), path.name)
        assert cells[0].kind == "markdown" and cells[0].source.startswith("# Lesson"), path.name
        assert any("exercise" in c.tags for c in cells), f"{path.name}: no exercise cell"
        assert "## Exercises" in "\n".join(c.source for c in cells if c.kind == "markdown"), path.name
        assert list(COURSE.glob(f"test_lesson{int(path.name[:2])}_*.py")), f"{path.name} has no grader"


def test_the_course_sample_is_small_balanced_and_as_described():
    assert SAMPLE.stat().st_size <= SAMPLE_BYTES
    s = read_sample()
    assert s.keys() == {"x_train", "y_train", "x_test", "y_test", "pictures", "picture_index", "picture_labels",
                        "classes"}  # fmt: skip
    assert list(s["classes"]) == LABEL_NAMES
    for part, per_class in (("train", PER_CLASS[0]), ("test", PER_CLASS[1])):
        x, y = s[f"x_{part}"], s[f"y_{part}"]
        assert x.dtype == np.uint8 and x.shape == (per_class * len(LABEL_NAMES), 3, 16, 16)
        assert np.bincount(y, minlength=len(LABEL_NAMES)).tolist() == [per_class] * len(LABEL_NAMES)
        assert set(np.unique(x % 16)) == {8}  # 16 levels a colour
    assert s["pictures"].dtype == np.uint8 and s["pictures"].shape == (len(PICTURES), *IMAGE_SHAPE)
    assert tuple(s["picture_index"]) == PICTURES and len(np.unique(s["pictures"])) > 200  # whole: every bit


def test_the_course_sample_is_made_from_the_real_cifar10_by_its_recipe():
    batches = find_batches_dir(default_data_dir())
    if batches is None:
        pytest.skip("the real CIFAR-10 is not on this machine ($TINYCONV_DATA)")
    want, got = make_sample(batches), read_sample()
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k], got[k]), k


def test_the_lessons_draw_their_bars_with_tqdm_auto():
    """tqdm.auto draws a widget in Jupyter and text in a terminal; plain tqdm draws text in both."""
    for path in LESSONS:
        plain = re.search(r"^\s*(from tqdm import|import tqdm\b|from tqdm\.std import)", path.read_text(), re.M)
        assert plain is None, f"{path.name}: {plain.group(0).strip()!r}: use `from tqdm.auto import tqdm`"
    assert sum("from tqdm.auto import tqdm" in path.read_text() for path in LESSONS) >= 3  # 1, 3 and 10 have bars


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_the_lesson_runs_headless_and_draws_its_charts(lesson, tmp_path):
    if lesson.name.startswith("04") and not has_opencl():
        pytest.skip("lesson 4 needs an OpenCL device (make setup installs PoCL)")
    out = subprocess.run(
        [sys.executable, str(lesson)], capture_output=True, text=True, timeout=120, env=env(tmp_path), cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # a lesson's own checks of the student's answers (lessons 2, 7, 8) must pass the teacher's solutions
    assert "look again" not in out.stdout, out.stdout[-3000:]
    charts = sorted((tmp_path / "figures").rglob("*.svg"))
    assert charts, f"{lesson.name} drew no chart"
    for chart in charts:
        root = ET.fromstring(chart.read_text())  # well-formed SVG a browser can show
        assert root.tag.endswith("svg") and len(root) > 3, chart.name


def test_the_student_version_stubs_every_solution_and_the_notebooks_are_valid(tmp_path):
    written = build.build(tmp_path)
    # and charts.py beside the lessons, in each folder (and the data/ lessons 1 and 3 read, once build.py copies it)
    assert len([p for p in written if p.parent.name != "data"]) == 3 * len(LESSONS) + 2
    for lesson in LESSONS:
        teacher = lesson.read_text()
        student = (tmp_path / "student" / lesson.name).read_text()
        assert build.BEGIN not in student and build.END not in student
        assert student.count("raise NotImplementedError(") == teacher.count(build.BEGIN) > 0
        compile(student, lesson.name, "exec")
        for version, text in (("teacher", teacher), ("student", student)):
            nb = json.loads((tmp_path / version / lesson.with_suffix(".ipynb").name).read_text())
            assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["name"] == "python3"
            cells = build.parse_cells(text, lesson.name)
            assert [c["cell_type"] for c in nb["cells"]] == [c.kind for c in cells]
            for got, want in zip(nb["cells"], cells, strict=True):
                assert "".join(got["source"]) == want.source
                assert got["metadata"].get("tags", []) == want.tags
                if got["cell_type"] == "code":
                    assert got["outputs"] == [] and got["execution_count"] is None


def test_the_generator_refuses_broken_markers():
    with pytest.raises(build.LessonError, match="hint"):
        build.student_text("    # BEGIN SOLUTION\n    x = 1\n    # END SOLUTION\n", "l.py")
    with pytest.raises(build.LessonError, match="not closed"):
        build.student_text("# BEGIN SOLUTION\n# TODO: x\nx = 1\n", "l.py")
    with pytest.raises(build.LessonError, match="without"):
        build.student_text("x = 1\n# END SOLUTION\n", "l.py")
    teacher = "def f():\n    # BEGIN SOLUTION\n    # TODO: one\n    return 1\n    # END SOLUTION\n"
    assert build.student_text(teacher) == 'def f():\n    # TODO: one\n    raise NotImplementedError("TODO: one")\n'
