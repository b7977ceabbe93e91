"""Whether a solution got into something handed out: each solution block of the full lessons (the lines
between a ``# TODO:`` hint and ``# END SOLUTION``) looked for in every file, notebook and zip.

Lines are compared stripped, blank and comment lines left out, so re-indenting a block or moving it
into a notebook's JSON does not hide it; a block is found when its lines appear one after another.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BEGIN, END, TODO = "# BEGIN SOLUTION", "# END SOLUTION", "# TODO:"


@dataclass(frozen=True)
class Block:
    """One solution block: where it is (``lesson:line``) and its code lines, normalised."""

    where: str
    lines: tuple[str, ...]


def normalised(text: str) -> list[str]:
    """The code lines of ``text``, stripped; blank lines and comments left out."""
    return [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]


def solution_blocks(text: str, name: str) -> list[Block]:
    """The solution blocks of a full lesson's text."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() != BEGIN:
            i += 1
            continue
        stop = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == END)
        body = [line for line in lines[i + 1 : stop] if not line.strip().startswith(TODO)]
        blocks.append(Block(f"{name}:{i + 1}", tuple(normalised("\n".join(body)))))
        i = stop + 1
    return [b for b in blocks if b.lines]


def texts(name: str, data: bytes) -> Iterator[tuple[str, str]]:
    """(name, text) of a file's contents: a notebook's cells, each member of a zip, a text file as it is."""
    if name.endswith(".zip"):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for member in z.namelist():
                if not member.endswith("/"):
                    yield from texts(f"{name}!{member}", z.read(member))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return  # not text: no code in it
    if name.endswith(".ipynb"):
        try:
            cells = json.loads(text).get("cells", [])
        except (json.JSONDecodeError, AttributeError):
            cells = []
        text += "\n" + "\n".join("".join(c.get("source", "")) for c in cells if isinstance(c, dict))
    yield name, text


def found_in(block: Block, lines: list[str]) -> bool:
    n = len(block.lines)
    return any(lines[i : i + n] == list(block.lines) for i, line in enumerate(lines) if line == block.lines[0])


def leaks(blocks: list[Block], paths: list[Path]) -> list[str]:
    """``"FILE holds the solution at LESSON:LINE"`` for every block found in a file under ``paths`` (files,
    folders, zips)."""
    found = []
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    for f in files:
        for name, text in texts(str(f), f.read_bytes()):
            lines = normalised(text)
            found += [f"{name} holds the solution at {b.where}" for b in blocks if found_in(b, lines)]
    return found
