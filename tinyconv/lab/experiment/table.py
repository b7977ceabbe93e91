"""The grid's results: one CSV row per run (and the same rows as JSON), read back to resume, summed up.

The columns (:data:`COLUMNS`) are a contract: the plots and the simulator read them by name.
The CSV is appended to one row at a time, flushed, so a grid cut short keeps every finished
cell; a re-run reads it back (:func:`read_rows`), drops a half-written last line, and skips
the cells whose key columns (``grid.KEY``) it already holds. A file written before some of the
columns existed (:data:`OLDER`: parallel, rebalance, wire, pipeline, ...) reads with what its rows
meant by them, and is rewritten once with every column. The JSON beside it (``grid.json`` for
``grid.csv``) is rewritten whole after every cell, with typed values.

A file measured under other settings is refused rather than mixed: rows of one CSV must agree
on :data:`SETTINGS` (steps, warm-up, settle, transport; the options :data:`FLAGS` set them) -- a
different --timed-steps makes a different measurement, not another repeat of the same one. Host and
time may differ: each row says its own.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tinyconv.lab.experiment.grid import BY_IMAGES, KEY, NOT_SPLIT, PIPELINE
from tinyconv.lab.paper import paper_speedup
from tinyconv.report import format_table

# name -> type; the first 26 are the contract (keep their names), the rest extras
COLUMNS: dict[str, type] = {
    "arch": str, "norm": str, "batch": int, "participants": int, "fuse": str, "split": str,
    "backend": str, "transport": str, "repeat": int, "steps": int,
    "step_s": float, "step_s_min": float, "step_s_max": float,
    "comm_s": float, "conv_s": float, "comp_s": float, "bytes_sent": int, "bytes_recv": int,
    "solo_step_s": float, "speedup": float, "shares": str, "link": str, "host": str, "timestamp": str,
    # extras
    "warmup": int, "settle": int, "channel_shares": str, "workers": str, "parallel": str,
    "rebalance": str, "wire": str, "wire_fallbacks": int, "wire_formats": str, "pipeline": str,
    "devices": str, "speeds": str,  # CPU quotas (grid.Cell.devices) and calibrated speeds, both master first
}  # fmt: skip
# columns added since the first grids: what a row written before them means, for a distributed row
# and for the master alone (which has no rebalancer and sends nothing)
OLDER: dict[str, tuple[str, str]] = {
    "parallel": ("model", "model"), "rebalance": ("on", NOT_SPLIT), "wire": ("fp32", NOT_SPLIT),
    "wire_fallbacks": ("0", "0"), "wire_formats": ("", ""),
    "pipeline": ("0", NOT_SPLIT),  # before the pipeline, a model-parallel step sent the whole batch at once
    "devices": (NOT_SPLIT, NOT_SPLIT), "speeds": ("", ""),
}  # fmt: skip
MODEL_ONLY = ("pipeline",)  # of OLDER, the columns a data-parallel or hybrid row has none of: "-" there
SETTINGS = ("steps", "warmup", "settle", "transport")
FLAGS = {"steps": "--timed-steps", "warmup": "--untimed-steps", "settle": "--settle", "transport": "--transport"}


class GridFileError(ValueError):
    """The --out file cannot be resumed: its message says why, in one line."""


def json_path(csv_path: Path) -> Path:
    return csv_path.with_suffix(".json")


def typed(row: dict[str, str]) -> dict[str, Any]:
    """A CSV row (all text) with each column's type."""
    return {name: COLUMNS[name](row[name]) for name in COLUMNS}


def read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows already in ``path`` (typed) and whether a half-written last line was dropped from
    the file. A missing or empty file has none. GridFileError if it is not a grid CSV of these columns."""
    if not path.exists() or path.stat().st_size == 0:
        return [], False
    text = path.read_text()
    cut = not text.endswith("\n")
    if cut:  # the previous run died mid-row: keep the whole lines, write the rest again
        text = text[: text.rfind("\n") + 1]
        with open(path, "r+") as f:
            f.truncate(len(text.encode()))
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None:
        return [], cut
    header = list(reader.fieldnames)
    missing = [c for c in COLUMNS if c not in header]  # fine if all are newer than the file (OLDER)
    lacking, unknown = [c for c in missing if c not in OLDER], [c for c in header if c not in COLUMNS]
    if lacking or unknown or header != [c for c in COLUMNS if c in header]:
        said = [f"missing {', '.join(lacking)}"] if lacking else []
        said += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise GridFileError(
            f"{path} has other columns than this grid writes ({'; '.join(said) or 'order'}); give another --out"
        )
    try:
        rows = [typed({**r, **{c: older(c, r) for c in missing}}) for r in reader]
    except (TypeError, ValueError) as e:
        raise GridFileError(f"{path} has a row that does not parse ({e}); give another --out") from None
    if missing:  # written before the newer columns: rewritten with every column, so the rows appended fit
        _rewrite(path, rows)
    return rows, cut


def older(column: str, row: dict[str, str]) -> str:
    """What ``row``, written before ``column`` existed, means by it (:data:`OLDER`)."""
    distributed, alone = OLDER[column]
    if row.get("participants") == "1":
        return alone
    if column in MODEL_ONLY and row.get("parallel", "model") in BY_IMAGES:  # no parallel column: model
        return NOT_SPLIT
    return distributed


def check_settings(path: Path, rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> None:
    """GridFileError if the rows were measured with other ``settings`` than this run's."""
    for row in rows:
        differ = {k: row[k] for k in SETTINGS if row[k] != settings[k]}
        if differ:
            were = " ".join(f"{FLAGS[k]} {v}" for k, v in differ.items())
            now = " ".join(f"{FLAGS[k]} {settings[k]}" for k in differ)
            raise GridFileError(
                f"{path} was measured with {were}, not {now}: re-run with those to resume it, or give another --out"
            )


def done_keys(rows: Sequence[dict[str, Any]]) -> set[tuple[str, ...]]:
    return {tuple(str(r[k]) for k in KEY) for r in rows}


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to the CSV (with the header first if the file is new), flushed to disk."""
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS), lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerow({k: _text(row[k]) for k in COLUMNS})
        f.flush()
        os.fsync(f.fileno())


def _rewrite(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Replace the CSV at ``path`` by ``rows`` under this grid's header, atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: _text(r[k]) for k in COLUMNS} for r in rows)
    os.replace(tmp, path)


def write_json(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """All ``rows`` as a JSON list, replacing the file atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([{k: r[k] for k in COLUMNS} for r in rows], indent=1) + "\n")
    os.replace(tmp, path)


def _text(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)  # repr: a float read back is the same float


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """Median speedup over repeats: a row per arch x batch, a column per participants (and per
    fuse / split / parallel / rebalance / wire / pipeline / backend / norm when the rows have several), and
    the paper's values at those participant counts (2 CPUs at least)."""
    ways = {_way(r) for r in rows}
    # one column per participant count, unless the rows split (or run) more than one way
    many = len({w[1:] for w in ways if w[0] > 1}) > 1 or len({w[-2:] for w in ways}) > 1
    columns = sorted(ways) if many else sorted({(w[0],) for w in ways})
    cell_rows = []
    for arch, batch in sorted(dict.fromkeys((r["arch"], r["batch"]) for r in rows), key=_by_batch_then_size):
        speeds = []
        for col in columns:
            got = [r["speedup"] for r in rows if (r["arch"], r["batch"], *_way(r)[: len(col)]) == (arch, batch, *col)]
            speeds.append(f"{_median(got):.2f}x" if got else "")
        cell_rows.append((arch, batch, *speeds, _paper(arch, [c[0] for c in columns])))
    headers = ("arch", "batch", *(_header(c) for c in columns), "paper (CPUs)")
    devices = max((r for r in rows if r.get("devices", NOT_SPLIT) != NOT_SPLIT), key=lambda r: r["participants"],
                  default=None)  # fmt: skip
    on = f", devices of {devices['devices']} cores (CPU quotas, the master first)" if devices else ""
    return format_table(headers, cell_rows, title=f"speedup (median over repeats) against the master alone{on}")


def _paper(arch: str, participants: Sequence[int]) -> str:
    """The paper's speedups of ``arch`` at the participant counts measured (at least 2): "1.98x (2), 3.28x (4)"."""
    known = [(p, paper_speedup(arch, p)) for p in sorted(set(participants) | {2})]
    return ", ".join(f"{s:.2f}x ({p})" for p, s in known if s) or "not known"


def _by_batch_then_size(cell: tuple[str, int]) -> tuple:
    """Cells in reading order, whatever order a resumed grid ran them in: by batch, then by kernels."""
    arch, batch = cell
    kernels = tuple(int(k) if k.isdigit() else 0 for k in str(arch).split(":"))
    return batch, kernels, str(arch)


def _way(r: dict[str, Any]) -> tuple:
    """How the row's step was shared, then where it ran (backend, norm: the last two)."""
    alone = r["participants"] == 1
    return (r["participants"], r["fuse"], r["split"], r.get("parallel", "model"),
            r.get("rebalance", NOT_SPLIT if alone else "on"), r.get("wire", NOT_SPLIT if alone else "fp32"),
            r.get("pipeline", NOT_SPLIT), r["backend"], r["norm"])  # fmt: skip


def _header(col: tuple) -> str:
    if len(col) == 1:
        return f"{col[0]} participant{'s' if col[0] > 1 else ''}"
    p, fuse, split, parallel, rebalance, wire, pipeline, backend, norm = col
    if p == 1:
        return f"1 (alone) {backend} {norm}"
    fixed = " rebalance off" if rebalance == "off" else ""  # the defaults (on, fp32, PIPELINE) go unsaid
    if parallel != "model":
        return f"{p} {parallel}-parallel{fixed} {backend} {norm}"
    narrow = f" wire {wire}" if wire != "fp32" else ""
    chunks = f" pipeline {pipeline}" if pipeline not in (NOT_SPLIT, str(PIPELINE)) else ""
    return f"{p} fuse {fuse} split {split}{fixed}{narrow}{chunks} {backend} {norm}"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
