"""Charts as standalone SVG (no plotting library needed), from a run's metrics, the experiment
grid's CSV or the simulator's CSV -- the kind of each file is told by its ending and columns.

    tinyconv plot run.jsonl -o plots/                       # curves.svg, split.svg; a distributed run
                                                            # also shares.svg and timeline.svg
    tinyconv plot solo.jsonl w1.jsonl w2.jsonl -o plots/    # the same, plus speedup.svg across runs
    tinyconv plot grid.csv -o plots/                        # grid-speedup.svg, grid-breakdown.svg
    tinyconv plot sim.csv -o plots/                         # sim-nodes.svg

One idea per file: svg.py (the document, ticks, colours, legend), lines.py, bars.py and gantt.py
(the three kinds of chart), tables.py (reading the inputs), and a file per input: run_charts.py
and share_charts.py (a run's metrics: how it went; how it shared its work), grid_charts.py, sim_charts.py."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tinyconv.lab.plot.run_charts import plot_runs
from tinyconv.lab.plot.tables import kind_of, read_table
from tinyconv.options import Parser, UsageError

__all__ = ["main", "plot_files", "plot_runs"]


def plot_table(path: Path, kind: str, out_dir: Path) -> list[Path]:
    """The charts of one grid or simulator table, named after it: grid.csv -> grid-speedup.svg, ..."""
    from tinyconv.lab.plot.grid_charts import breakdown_chart, speedup_chart
    from tinyconv.lab.plot.sim_charts import nodes_chart

    rows = read_table(path)
    charts = {"speedup": speedup_chart, "breakdown": breakdown_chart} if kind == "grid" else {"nodes": nodes_chart}
    written = []
    for name, chart in charts.items():
        written.append(out_dir / f"{path.stem}-{name}.svg")
        written[-1].write_text(chart(rows))
    return written


def plot_files(paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Every chart of these inputs into ``out_dir``: the metrics files together (one set of run
    charts), each table on its own. Returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = {Path(p): kind_of(Path(p)) for p in paths}
    runs = [p for p, k in kinds.items() if k == "metrics"]
    written = plot_runs(runs, out_dir) if runs else []
    for path, kind in kinds.items():
        if kind != "metrics":
            written += plot_table(path, kind, out_dir)
    return written


def check_paths(inputs: Sequence[str], out: str) -> None:
    """Bad input before any chart: each input a readable file, ``--out`` a folder that can be written."""
    for name in inputs:
        if not Path(name).is_file():
            raise UsageError(f"{name}: {'a folder, not a file' if Path(name).is_dir() else 'no such file'}")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {out} is a file: give a folder for the SVG files")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UsageError(f"--out {out} cannot be written: {e.strerror or e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(
        prog="tinyconv plot",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", help="metrics files (.jsonl, from --metrics-out), grid or simulator CSVs")
    p.add_argument("-o", "--out", default="plots", help="folder for the SVG files (default %(default)s)")
    try:
        args = p.parse_args(argv)
        check_paths(args.inputs, args.out)
        files = plot_files(args.inputs, args.out)
    except UsageError as e:
        print(f"tinyconv plot: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # what an input holds
        print(f"tinyconv plot: error: cannot read the input: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tinyconv plot: error: {e.strerror or e} ({e.filename or 'writing the charts'})", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0
