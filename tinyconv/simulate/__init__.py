"""``tinyconv simulate``: a training step's time and speedup for 1 to 128 participants, predicted.

    tinyconv simulate --measure devices.json --arch 300:1000 --batch 64         # time this machine, then predict
    tinyconv simulate --devices devices.json --nodes 1 2 4 8 16 32 64 128 \\
        --bandwidth 5 12.5 125 --medium wifi ethernet --out sim.csv
    tinyconv simulate --devices devices.json --device fast slow               # a mix: participants in turn
    tinyconv simulate --devices devices.json --against grid.csv              # predicted vs measured runs

Marques, Falcão & Alexandre (2017) simulated 32 and 128 nodes on a 5 MB/s Wi-Fi link and found
communication dominates beyond a few nodes. This does the same from measured numbers, for their
split and tinyconv's:

* ``devices.py`` -- the measured device file: per conv layer, a device's forward + backward
  time as fixed + per-kernel seconds (``shard/cost.py``'s affine model), with and without the
  fused tails, and the master's other work per step (comp). ``--measure`` times this machine.
* ``link.py`` -- one op's wall time on a link of bandwidth B and latency L per message: Wi-Fi,
  one shared half-duplex channel where every transfer waits its turn, or switched full-duplex
  Ethernet, where the master's NIC is the bottleneck each way. Formulas there.
* ``model.py`` -- shares by the paper's eq. 1, bytes per worker as ``comm.py`` counts them
  (exact against real steps), and the step: comp + the ops' wall times, which do not overlap
  one another; within an op, transfers overlap other participants' compute, never the same
  worker's (``shard/rpc.py``, ``shard/by_kernels.py``). Formulas there.
* ``against.py`` -- the model beside an experiment grid's measured rows, with the error.

Columns of ``--out``: arch, batch, split, medium, bandwidth_MBps, latency_ms, nodes, step_s,
comm_s, conv_s, comp_s, speedup (the contract), then fuse, label, norm, devices, bytes_sent,
bytes_recv, solo_step_s. ``split`` and ``fuse`` are the main job's options: the paper's split
is fuse off, split kernels.

What it says (300:1000, batch 64, this project's 2-core VM measured as one device, 1 ms a
message): see FINDINGS below, written from a real ``--measure``; rerun it for your devices.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv simulate ARGS``; 0 on success, 2 on bad input (one line on stderr)."""
    args = list(sys.argv[1:] if argv is None else argv)
    # --measure times one paper-style CPU: one BLAS thread, which BLAS reads once, when numpy loads
    if "--measure" in args and "numpy" not in sys.modules:
        for var in BLAS_THREADS:
            os.environ[var] = "1"
    from tinyconv.simulate.cli import run

    return run(args)
