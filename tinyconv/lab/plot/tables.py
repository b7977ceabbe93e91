"""The plot's inputs: which kind each file is, and CSV (or JSON) rows as typed values.

Three kinds: a run's metrics file (JSON lines, ``--metrics-out``), the experiment grid's CSV
(``tinyconv experiment grid``) and the simulator's CSV (``tinyconv simulate``). The two tables
are told apart by their columns, not by their names; columns beyond the ones a chart reads are
ignored, so either table may grow.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# the columns a chart needs of each table (the tables have more)
GRID_COLUMNS = ("arch", "batch", "participants", "step_s", "comm_s", "conv_s", "comp_s")
SIM_COLUMNS = ("arch", "batch", "split", "bandwidth_MBps", "nodes", "speedup")


def kind_of(path: Path) -> str:
    """ "metrics", "grid" or "simulation", from the file's ending and, for a table, its columns."""
    if path.suffix in (".jsonl", ".ndjson"):
        return "metrics"
    if path.suffix not in (".csv", ".json"):
        raise ValueError(f"{path}: not a metrics file (.jsonl) nor a table (.csv, .json)")
    columns = set(read_table(path)[0]) if path.suffix == ".json" else set(_header(path))
    if set(SIM_COLUMNS) <= columns:
        return "simulation"
    if set(GRID_COLUMNS) <= columns:
        return "grid"
    raise ValueError(
        f"{path}: neither the grid's columns ({', '.join(GRID_COLUMNS)}) nor the simulator's ({', '.join(SIM_COLUMNS)})"
    )


def _header(path: Path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def read_table(path: Path) -> list[dict[str, Any]]:
    """Every row, numbers as numbers (an empty cell is None); a .json holds a list of rows."""
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
            raise ValueError(f"{path}: not a list of rows")
        return rows
    with open(path, newline="") as f:
        rows = [{k: _value(v) for k, v in row.items()} for row in csv.DictReader(f)]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _value(text: str | None) -> Any:
    if text is None or text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def number(row: dict[str, Any], key: str) -> float | None:
    """A finite number from ``row[key]``, else None (missing, empty, text, NaN)."""
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def median(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return statistics.median(finite) if finite else None


def varying(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """Those of ``keys`` whose value is not the same in every row: what must tell series apart."""
    return [k for k in keys if len({str(r.get(k)) for r in rows}) > 1]


def describe(row: dict[str, Any], keys: Sequence[str]) -> str:
    """Settings as a person writes them: "fuse off, split kernels, link 5MBps"."""
    return ", ".join(f"{k} {row.get(k) if row.get(k) is not None else '-'}" for k in keys)
