#!/usr/bin/env python3
"""One source, two versions: the teacher's lessons -> the students' lessons and both as notebooks.

    python course/build.py                 # writes course/_build/ (gitignored)
    python course/build.py --out DIR       # somewhere else, e.g. the folder you hand out

A lesson (``course/NN_name.py``) is a jupytext *percent* file: cells start with a line ``# %%``;
``# %% [markdown]`` starts a prose cell whose lines are ``# `` comments; ``tags=["setup"]`` or
``tags=["exercise"]`` after the ``%%`` tag a cell (jupytext reads the same syntax). In the teacher
version each exercise's answer sits between two markers, the first followed by a hint::

        # BEGIN SOLUTION
        # TODO: im2col the input, then one matrix product
        cols = im2col(x, kh, kw, stride, padding)
        ...
        # END SOLUTION

The student version keeps the hint and replaces the answer by a stub that fails loudly::

        # TODO: im2col the input, then one matrix product
        raise NotImplementedError("TODO: im2col the input, then one matrix product")

Written to ``OUT/student/`` (the .py files and their .ipynb) and ``OUT/teacher/`` (the teacher's
.ipynb). The notebooks are nbformat v4 JSON written here from the cells, outputs empty: Jupyter
and jupytext open them as they are; no dependency beyond the standard library.

``make course`` (``course/pack/make.py``) builds the students' pack from the same functions: the
student lessons and their notebooks, the graders, ``grade.py`` and the points per exercise, zipped.

Why a gitignored build directory and not committed copies: the .py lessons are the only source, so
a copy can never be stale or edited by mistake; ``tests/test_course.py`` builds into a temporary
directory and grades what it built, which is the freshness check that matters.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LESSON = re.compile(r"^\d\d_\w+\.py$")  # 01_convolution_by_hand.py
CELL = re.compile(r"^# %%(?P<rest>.*)$")
TAGS = re.compile(r"tags=(\[[^\]]*\])")
BEGIN, END, TODO = "# BEGIN SOLUTION", "# END SOLUTION", "# TODO:"


class LessonError(ValueError):
    """A lesson file that does not follow the format above; the message names the file and line."""


@dataclass
class Cell:
    """One notebook cell: ``kind`` "code" or "markdown", its ``tags``, its source lines (no newlines)."""

    kind: str
    tags: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    header_line: int = 0  # the line number (from 1) of its "# %%": its text starts on the next one

    def code(self) -> str:
        """The code as compiled with the lesson's own line numbers, for tracebacks that point into the file."""
        return "\n" * self.header_line + "\n".join(self.lines) + "\n"

    @property
    def source(self) -> str:
        """The cell's text: code as written, markdown without its leading ``# ``."""
        if self.kind == "code":
            return "\n".join(self.lines).strip("\n")
        return "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in self.lines).strip("\n")


def lessons(folder: Path = HERE) -> list[Path]:
    """The lesson files of ``folder``, in order (``NN_name.py``)."""
    return sorted(p for p in folder.iterdir() if LESSON.match(p.name))


def parse_cells(text: str, name: str = "lesson") -> list[Cell]:
    """Split a percent-format file into cells. Text before the first ``# %%`` is not a cell."""
    cells: list[Cell] = []
    for number, line in enumerate(text.splitlines(), 1):
        m = CELL.match(line)
        if m is None:
            if cells:
                cells[-1].lines.append(line)
            continue
        rest = m.group("rest")
        tags = TAGS.search(rest)
        try:
            tag_list = json.loads(tags.group(1)) if tags else []
        except json.JSONDecodeError as e:
            raise LessonError(f'{name}:{number}: tags must be a JSON list of strings, e.g. tags=["setup"]: {e}') from e
        cells.append(Cell("markdown" if "[markdown]" in rest else "code", tag_list, header_line=number))
    if not cells:
        raise LessonError(f"{name}: no '# %%' cell found; is it a jupytext percent-format file?")
    return [c for c in cells if c.source or c.kind == "code" and c.tags]


def student_text(text: str, name: str = "lesson") -> str:
    """The student version of a lesson's text: every solution block replaced by its hint and a stub."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END:
            raise LessonError(f"{name}:{i + 1}: '{END}' without a '{BEGIN}' before it")
        if line.strip() != BEGIN:
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        hint = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if not hint.startswith(TODO):
            raise LessonError(f"{name}:{i + 2}: the line after '{BEGIN}' must be the hint, '{TODO} ...'")
        stop = next((j for j in range(i + 1, len(lines)) if lines[j].strip() in (BEGIN, END)), None)
        if stop is None or lines[stop].strip() != END:
            raise LessonError(f"{name}:{i + 1}: '{BEGIN}' is not closed by '{END}' before the next one")
        what = hint[len(TODO) :].strip()
        out += [f"{indent}{hint}", f"{indent}raise NotImplementedError({json.dumps('TODO: ' + what)})"]
        i = stop + 1
    return "\n".join(out) + "\n"


def notebook(cells: list[Cell]) -> dict:
    """nbformat v4 (minor 4: no cell ids needed) from the cells; code cells unexecuted."""
    out = []
    for c in cells:
        source = c.source.splitlines(keepends=True)
        cell: dict = {"cell_type": c.kind, "metadata": {"tags": c.tags} if c.tags else {}, "source": source}
        if c.kind == "code":
            cell.update(execution_count=None, outputs=[])
        out.append(cell)
    return {
        "cells": out,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python", "pygments_lexer": "ipython3"},
            "jupytext": {"formats": "ipynb,py:percent"},
        },
        "nbformat": 4,
        "nbformat_minor": 4,
    }


def build(out: Path, source: Path = HERE) -> list[Path]:
    """Write the student lessons (.py, .ipynb) to ``out/student`` and the teacher notebooks to
    ``out/teacher``; returns the files written."""
    written = []
    found = lessons(source)
    if not found:
        raise LessonError(f"no lessons (NN_name.py) in {source}")
    for path in found:
        text = path.read_text()
        student = student_text(text, path.name)
        for version, body in (("teacher", text), ("student", student)):
            folder = out / version
            folder.mkdir(parents=True, exist_ok=True)
            if version == "student":
                written.append(folder / path.name)
                written[-1].write_text(body)
            nb = folder / path.with_suffix(".ipynb").name
            nb.write_text(json.dumps(notebook(parse_cells(body, path.name)), indent=1) + "\n")
            written.append(nb)
    for version in ("teacher", "student"):  # what every lesson imports or reads, beside it
        written.append(out / version / "charts.py")
        shutil.copyfile(source / "charts.py", written[-1])
        for data in sorted((source / "data").glob("*")):  # the images lessons 1 and 3 use offline
            (out / version / "data").mkdir(exist_ok=True)
            written.append(out / version / "data" / data.name)
            shutil.copyfile(data, written[-1])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python course/build.py",
        description="Write the student version of every lesson (solutions replaced by stubs) and the "
        ".ipynb notebooks of both versions.",
    )
    parser.add_argument("--out", type=Path, default=HERE / "_build", help="where to write (default course/_build)")
    args = parser.parse_args(argv)
    try:
        files = build(args.out)
    except LessonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} files to {args.out}: student/ (hand these out), teacher/ (the notebooks with answers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
