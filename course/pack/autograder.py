"""Zips: the student pack as it is, and the autograder in Gradescope's format.

Gradescope unpacks the autograder zip into ``/autograder/source``, runs ``setup.sh`` once when it
builds the image, then ``run_autograder`` for each submission (the student's files in
``/autograder/submission``), which must write ``/autograder/results/results.json``. Both scripts are
in this folder; the zip adds ``grade.py``, the points, the graders and tinyconv's source.

The zips are reproducible: their members are sorted and dated 1980-01-01, scripts 0755, the rest 0644.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("setup.sh", "run_autograder")
LIBRARY = ("pyproject.toml", "README.md", "tinyconv", "backends", "transports")  # what pip installs tinyconv from
SKIP = {"__pycache__", ".pytest_cache", ".ruff_cache"}


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not SKIP & set(p.parts) and p.suffix != ".pyc")


def add(z: zipfile.ZipFile, path: Path, name: str) -> None:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = (0o100755 if name.split("/")[-1] in SCRIPTS else 0o100644) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, path.read_bytes())


def zip_tree(folder: Path, zip_path: Path, prefix: str = "") -> list[str]:
    """Zip everything under ``folder``, named ``prefix/...``; returns the members' names."""
    names = []
    with zipfile.ZipFile(zip_path, "w") as z:
        for f in files_under(folder):
            names.append(f"{prefix}/{f.relative_to(folder).as_posix()}".lstrip("/"))
            add(z, f, names[-1])
    return names


def write(pack: Path, zip_path: Path, repository: Path) -> list[str]:
    """The autograder zip from a built ``pack`` and tinyconv's ``repository``; returns the members' names."""
    members = [(HERE / s, s) for s in SCRIPTS]
    members += [(pack / "grade.py", "grade.py"), (pack / "points.toml", "points.toml")]
    members += [(f, f"graders/{f.relative_to(pack / 'graders').as_posix()}") for f in files_under(pack / "graders")]
    for part in LIBRARY:
        members += [(f, f"library/{f.relative_to(repository).as_posix()}") for f in files_under(repository / part)]
    with zipfile.ZipFile(zip_path, "w") as z:
        for path, name in members:
            add(z, path, name)
    return [name for _, name in members]
