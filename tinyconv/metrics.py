"""The JSON-lines metrics file: one object per line, each with an ``event`` field.

The schema is a contract that plots, reports and outside tools read
(docs/metrics.md): ``run`` first, then ``step`` per training step and ``epoch``
per epoch, and ``summary`` last.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO


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
    """Appends events to a .jsonl file (flushed per line, so a crash loses nothing)."""

    def __init__(self, path: str | Path | None, append: bool = False) -> None:
        self.path = Path(path) if path else None
        self._f: TextIO | None = None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a" if append else "w")

    def write(self, event: str, **fields: Any) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(_clean({"event": event, **fields})) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All events of a metrics file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
