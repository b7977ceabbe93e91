"""A student's lesson files, as the graders read them: ``NN_name.py``, or the notebook ``NN_name.ipynb``.

A student may hand in either (or both, paired by jupytext): the newer one is graded, the ``.py`` on a
tie. A notebook is turned back into the percent format the graders parse (``# %%`` cells, their tags
kept): the graders find the exercises by the ``exercise`` tag, which Jupyter keeps in the cell's
metadata. The files may sit in a subfolder (an uploaded zip of a folder): the shallowest counts.

Standard library only: the student pack and the autograder run this.
"""

from __future__ import annotations

import json
from pathlib import Path

SKIP = {"graders", "__MACOSX", "__pycache__", ".ipynb_checkpoints"}


def find(folder: Path, stem: str) -> Path | None:
    """The file to grade for lesson ``stem`` in ``folder``: its .py or its .ipynb, the newer (.py on a tie),
    in ``folder`` itself or else in the shallowest subfolder that has one."""
    found = [
        p
        for name in (f"{stem}.py", f"{stem}.ipynb")
        for p in folder.rglob(name)
        if p.is_file() and not SKIP & set(p.relative_to(folder).parts)
    ]
    if not found:
        return None
    nearest = min(found, key=lambda p: (len(p.relative_to(folder).parts), str(p))).parent
    return max((p for p in found if p.parent == nearest), key=lambda p: (p.stat().st_mtime, p.suffix == ".py"))


def percent_from_notebook(nb: dict) -> str:
    """A notebook's cells as a percent-format script: ``# %% [markdown]`` prose, ``# %% tags=[...]`` code."""
    parts = []
    for cell in nb.get("cells", []):
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else source
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("cell_type") == "markdown":
            body = "\n".join(f"# {line}" if line else "#" for line in text.splitlines())
            parts.append("# %% [markdown]\n" + body)
        elif cell.get("cell_type") == "code":
            header = "# %%" + (f" tags={json.dumps(tags)}" if tags else "")
            parts.append(header + "\n" + text)
    return "\n\n".join(parts) + "\n"


def stage(folder: Path, stems: list[str], into: Path) -> dict[str, Path | None]:
    """Write each lesson's file to grade to ``into/STEM.py`` (a notebook converted); returns where each came
    from (None: not handed in, so not written: its graders then fail on the missing file)."""
    into.mkdir(parents=True, exist_ok=True)
    sources = {}
    for stem in stems:
        path = sources[stem] = find(folder, stem)
        if path is None:
            continue
        if path.suffix == ".ipynb":
            try:
                text = percent_from_notebook(json.loads(path.read_text(encoding="utf-8")))
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                why = json.dumps(f"{path.name} is not a notebook (nbformat JSON): {e}")
                text = f'# %% tags=["exercise"]\nraise SyntaxError({why})\n'  # each of its tests fails, saying so
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
        (into / f"{stem}.py").write_text(text, encoding="utf-8")
    return sources
