"""The docs stay true: the command blocks README.md and docs/*.md mark runnable run, and their links resolve.

A block is marked by ``<!-- runnable -->`` on the line before its opening fence (```` ```sh ````); the
marker must sit right above a sh block. Each command line of a marked block (a line ending in ``\\`` goes on
to the next; ``#`` starts a comment) runs under bash in a temporary folder of the block's own, with the
repository's ``.venv/bin`` first on ``PATH``, and must exit 0. Offline: ``$TINYCONV_DATA`` is an empty
folder and HTTP goes to a closed port, so a block that would download CIFAR-10 fails at once.

A path a block names under one of the repository's top-level entries (``examples/cifar10_dist.py``,
``course/...``, ``.venv/bin/python``) must exist in the repository, or the block fails, naming it, before
that line runs; the entry is linked into the temporary folder, so ``python examples/cifar10_dist.py`` runs
there as in a checkout. Paths a line writes (after ``>``, ``--out``, ``-o``, ``--metrics-out``,
``--checkpoint``) and paths an earlier line made are the block's own. Every sh block, marked or not, is
held to the first rule. docs/tests-and-benchmarks.md says the same for the docs' writers.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
SHELLS = ("sh", "bash", "shell")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
WRITES = {">", ">>", "--out", "-o", "--metrics-out", "--checkpoint"}  # the next word is a path the line writes
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
TIMEOUT_S = 120  # one command line; the whole file takes well under a minute on 2 cores


@dataclass
class Block:
    page: Path
    line: int  # 1-based, the opening fence
    lang: str
    body: list[str]
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(text: str, page: Path = ROOT / "README.md") -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a page, and its lines outside them (number, text): a fence closes only on a
    fence of its own character at least as long, so a ```` ```` ```` block can show a marked one unrun."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    open_fence: str | None = None
    previous = ""
    for n, line in enumerate(text.splitlines(), 1):
        if open_fence is None:
            m = FENCE.match(line)
            if m:
                open_fence = m.group(1)
                blocks.append(Block(page, n, m.group(2), [], previous.strip() == MARKER))
            else:
                prose.append((n, line))
        elif line.strip().startswith(open_fence[0] * len(open_fence)) and not line.strip().strip(open_fence[0]):
            open_fence = None
        else:
            blocks[-1].body.append(line)
        previous = line
    return blocks, prose


def command_lines(body: list[str]) -> list[str]:
    """A block's command lines: continuations joined, blank lines and comment lines dropped."""
    out: list[str] = []
    pending = ""
    for raw in body:
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending.strip())
    return out


def named_paths(command: str) -> tuple[list[str], list[str]]:
    """The relative paths a command line names: (read, written)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an unclosed quote: not a command we can read, let bash say so
        return [], []
    read: list[str] = []
    written: list[str] = []
    for before, word in zip(["", *words[:-1]], words, strict=True):
        if word.startswith("-") and "=" in word:  # --out=PATH
            before, word = word.split("=", 1)
        if "/" not in word or "://" in word or word.startswith(("/", "~", "$", "-", "..")):
            continue
        (written if before in WRITES else read).append(word)
    return read, written


def missing_from_repo(path: str) -> bool:
    """A path under one of the repository's top-level entries that the repository does not have."""
    first = Path(path).parts[0]
    return (ROOT / first).exists() and not (ROOT / path).exists()


def pages_blocks() -> list[Block]:
    return [b for page in PAGES for b in read_blocks(page.read_text(encoding="utf-8"), page)[0]]


RUNNABLE = [b for b in pages_blocks() if b.runnable]


def environment(tmp: Path) -> dict[str, str]:
    bins = [str(ROOT / ".venv" / "bin"), str(Path(sys.executable).parent)]
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "all_proxy")}
    env["PATH"] = os.pathsep.join([*bins, env.get("PATH", "")])
    env["TINYCONV_DATA"] = str(tmp / ".no-data")  # empty: a block that needs CIFAR-10 would download it...
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[proxy] = "http://127.0.0.1:9"  # ...and fails at once instead, offline
    return env


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_block(block: Block, tmp_path: Path):
    assert block.lang in SHELLS, f"{block.where}: {MARKER} marks a {block.lang or 'plain'} block, not a sh one"
    lines = command_lines(block.body)
    assert lines, f"{block.where}: a marked block with no command"
    env = environment(tmp_path)
    for command in lines:
        read, _ = named_paths(command)
        for path in read:
            if (tmp_path / path).exists():
                continue  # an earlier line of the block made it
            assert not missing_from_repo(path), f"{block.where}: `{command}` names {path}, which the repository lacks"
            first = Path(path).parts[0]
            if (ROOT / first).exists() and not (tmp_path / first).exists():
                (tmp_path / first).symlink_to(ROOT / first)
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        assert done.returncode == 0, (
            f"{block.where}: `{command}` exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )


def test_the_readme_has_runnable_blocks():
    readme = [b for b in RUNNABLE if b.page.name == "README.md"]
    assert len(readme) >= 2, "README.md should mark its smoke run and other fast, offline commands runnable"


def test_every_sh_block_names_files_that_exist():
    wrong = []
    for block in pages_blocks():
        if block.lang not in SHELLS:
            continue
        made: set[str] = set()
        for command in command_lines(block.body):
            read, written = named_paths(command)
            wrong += [f"{block.where}: {p}" for p in read if p not in made and missing_from_repo(p)]
            made.update(written)
    assert not wrong, "sh blocks name files the repository lacks:\n" + "\n".join(wrong)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in read_blocks(page.read_text(encoding="utf-8"), page)[1]:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose_text(page: Path) -> str:
    """The page with its code blocks and code spans blanked out, line numbers kept: what links can be in."""
    text = page.read_text(encoding="utf-8")
    lines = [""] * len(text.splitlines())
    for n, line in read_blocks(text, page)[1]:
        lines[n - 1] = re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), line)
    return "\n".join(lines)


def test_every_relative_link_resolves():
    wrong = []
    for page in PAGES:
        text = prose_text(page)
        for m in LINK.finditer(text):  # a link's text may wrap onto the next line
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            goal = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {target}"
            if not goal.exists():
                wrong.append(f"{where} (no such file)")
            elif anchor and goal.suffix == ".md" and anchor not in anchors(goal):
                wrong.append(f"{where} (no such heading in {goal.name})")
    assert not wrong, "links that lead nowhere:\n" + "\n".join(wrong)


def test_a_marker_in_a_longer_fence_is_shown_not_run():
    shown = "````markdown\n<!-- runnable -->\n```sh\nfalse\n```\n````\n"
    page = f"text\n\n{shown}\n<!-- runnable -->\n```sh\ntrue \\\n  --x # c\n```\n"
    blocks, _ = read_blocks(page)
    assert [(b.lang, b.runnable) for b in blocks] == [("markdown", False), ("sh", True)]
    assert command_lines(blocks[1].body) == ["true  --x # c"]
    assert named_paths("python examples/a.py --out runs/x.csv > b/c.txt --k=course/d.py") == (
        ["examples/a.py", "course/d.py"],
        ["runs/x.csv", "b/c.txt"],
    )
