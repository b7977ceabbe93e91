"""``tinyconv experiment grid``: the paper's speedup grid, one CSV (and JSON) row per run.

    tinyconv experiment grid --arch 50:500 150:800 300:1000 500:1500 --batch-size 64 128 256 \\
        --workers 0 1 --repeats 1 --timed-steps 3 --untimed-steps 2 --out runs/grid.csv

One idea per file:

* ``grid.py``    -- the cells, the order they run in, their expected cost, which are pending
* ``workers.py`` -- the workers, started once for the whole grid (local pinned, external, in-process)
* ``run.py``     -- timing one cell: solo and distributed steps alternated (bench_speedup uses it too)
* ``table.py``   -- the CSV / JSON rows (the column contract), resuming, the summary table
* ``grid_command.py`` -- the command line, tying them together; ``grid_checks.py`` -- its checks

Nothing here imports numpy before :func:`main` has set one BLAS thread per process.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv experiment ...``: 0 when the grid is done, 2 for bad input, 1 when a run fails."""
    from tinyconv.lab.experiment.grid_command import main as command_main

    return command_main(argv)


__all__ = ["main"]
