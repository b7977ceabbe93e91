"""The JSON-lines metrics file: one object per line, each with an ``event`` field.

The schema is a contract that plots, reports and outside tools read
(docs/metrics.md): ``run`` first, then ``step`` per training step and ``epoch``
per epoch, and ``summary`` last; the cluster's own events (``worker_lost``,
``worker_joined``) after the step they happened in.

The file is not touched until the run's first step (or its summary): the events before it
are held, so a run that fails before training -- a worker that never said hello, a bad
calibration -- leaves an existing file as it was. A resumed run first drops what the file
holds beyond the checkpoint's step (the steps the checkpoint does not have, which the
resumed run computes again), then appends: no step appears twice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

LIVE_EVENTS = ("step", "summary")  # the first of these opens the file


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

    ``append``: add to the file rather than replace it. ``resume_step``: with ``append``, first
    drop the file's lines from the first step after this one on (see :func:`drop_after_step`).
    """

    def __init__(self, path: str | Path | None, append: bool = False, resume_step: int | None = None) -> None:
        self.path = Path(path) if path else None
        self.append, self.resume_step = append, resume_step
        self._f: TextIO | None = None
        self._held: list[str] = []
        self.dropped = 0  # lines a resume dropped

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps(_clean({"event": event, **fields})) + "\n"
        if self._f is None:
            if event not in LIVE_EVENTS:
                self._held.append(line)
                return
            self._open()
        self._f.write(line)
        self._f.flush()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.append and self.resume_step is not None:
            self.dropped = drop_after_step(self.path, self.resume_step)
        self._f = open(self.path, "a" if self.append else "w")
        self._f.writelines(self._held)
        self._held = []

    def close(self) -> None:
        """Close the file; events still held (no step ever came) are dropped."""
        self._held = []
        if self._f is not None:
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
