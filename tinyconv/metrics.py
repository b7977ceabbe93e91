"""The JSON-lines metrics file: one object per line, each with an ``event`` field.

Its schema, when the file is first touched, what a resumed run drops and what a full disk does: docs/metrics.md.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, BinaryIO

LIVE_EVENTS = ("step", "summary")  # the first of these opens the file
MAX_UNWRITTEN = 64 << 20  # bytes of lines kept in memory while the file takes none; beyond, new lines are lost


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf and no numpy scalars: convert so every line parses anywhere."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Writes events to a .jsonl file, flushed per line, so a crash loses nothing once training runs.
    ``append``: add to the file, first dropping its lines past ``resume_step`` (:func:`drop_after_step`)."""

    def __init__(self, path: str | Path | None, append: bool = False, resume_step: int | None = None) -> None:
        self.path = Path(path) if path else None
        self.append, self.resume_step = append, resume_step
        self._f: BinaryIO | None = None
        self._held: list[str] = []
        self._unwritten = bytearray()  # lines the file did not take yet (a full disk)
        self.dropped = 0  # lines a resume dropped
        self.lost = 0  # lines lost because the file took nothing for MAX_UNWRITTEN bytes
        self.write_error: str | None = None  # why the file takes nothing now

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps(_clean({"event": event, **fields})) + "\n"
        if self._f is None:
            if event not in LIVE_EVENTS:
                self._held.append(line)
                return
            self._open()
        self._put(line.encode())

    def _put(self, data: bytes) -> None:
        """Write ``data`` after the lines still waiting; what the file does not take now waits for the next."""
        if len(self._unwritten) + len(data) > MAX_UNWRITTEN:
            self.lost += 1
        else:
            self._unwritten += data
        try:
            while self._unwritten:  # an unbuffered file: a write may take part, or raise with nothing taken
                del self._unwritten[: self._f.write(self._unwritten)]
        except OSError as e:
            if self.write_error is None:
                print(f"warning: the metrics file {self.path} takes no more lines ({e}); they wait in memory "
                      "and are written once it takes them again", file=sys.stderr)  # fmt: skip
            self.write_error = f"{type(e).__name__}: {e}"
            return
        self.write_error = None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.append and self.resume_step is not None:
            self.dropped = drop_after_step(self.path, self.resume_step)
        self._f = open(self.path, "ab" if self.append else "wb", buffering=0)  # each line written as it comes
        held, self._held = "".join(self._held), []
        self._put(held.encode())

    def close(self) -> None:
        """Close the file; events still held (no step ever came) are dropped."""
        self._held = []
        if self._f is not None:
            self._put(b"")  # a last try for the lines still waiting
            self._f.close()
            self._f = None


def drop_after_step(path: str | Path, step: int) -> int:
    """Cut the metrics file at ``path`` before its first ``step`` event past ``step`` (everything from
    there on belongs to steps a checkpoint of ``step`` does not have), or before an unfinished last
    line (a crash in mid-write). Returns how many lines were dropped; a missing file is left missing."""
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        lines = f.readlines()
    offset = 0
    for i, line in enumerate(lines):
        if _beyond(line, step):
            with open(path, "r+b") as f:
                f.truncate(offset)
            return len(lines) - i
        offset += len(line)
    return 0


def _beyond(line: bytes, step: int) -> bool:
    """Whether the file must be cut at ``line``: a step past ``step``, or a line a crash left unfinished."""
    if not line.endswith(b"\n"):
        return True
    try:
        event = json.loads(line)
    except ValueError:  # a damaged line amid finished ones: not ours to judge
        return False
    is_step = isinstance(event, dict) and event.get("event") == "step"
    return is_step and isinstance(event.get("step"), int) and event["step"] > step


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All events of a metrics file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
