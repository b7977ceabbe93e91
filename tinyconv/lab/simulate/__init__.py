"""``tinyconv simulate``: a training step's time and speedup for 1 to 128 participants, predicted.

    tinyconv simulate --measure --device-file devices.json --arch 300:1000 --batch-size 64  # time this machine
    tinyconv simulate --device-file devices.json --workers 0 1 3 7 15 31 63 127 \\
        --bandwidth 5 12.5 125 --medium wifi ethernet --out sim.csv
    tinyconv simulate --device-file devices.json --device-name fast slow     # a mix: participants in turn
    tinyconv simulate --device-file devices.json --wire-precision fp32 bf16 adt24  # the shards in narrower words
    tinyconv simulate --device-file devices.json --against grid.csv          # predicted vs measured runs

Marques, Falcão & Alexandre (2017) simulated 32 and 128 nodes on a 5 MB/s Wi-Fi link and found
communication dominates beyond a few nodes. This does the same from measured numbers, for their
split and tinyconv's:

* ``devices.py`` -- the measured device file: per conv layer, a device's forward + backward
  time as fixed + per-kernel seconds (``distributed/cost.py``'s affine model), with and without the
  fused tails, and the master's other work per step (comp). ``--measure`` times this machine.
* ``link_model.py`` -- one op's wall time on a link of bandwidth B and latency L per message: Wi-Fi,
  one shared half-duplex channel where every transfer waits its turn, or switched full-duplex
  Ethernet, where the master's NIC is the bottleneck each way. Formulas there.
* ``predict.py`` -- shares by the paper's eq. 1, bytes per worker as ``eq2.py`` counts them
  (exact against real steps), each array in its role's word under ``--wire-precision`` (fp32 4
  bytes, adt24 3, bf16 and fp16 2, s8 1 and a scale per plane; ``adaptive`` at AWP's start), and the step:
  comp + the ops' wall times, which do not overlap one another; within an op, transfers overlap
  other participants' compute, never the same worker's (``distributed/rpc.py``,
  ``shard/by_kernels.py``). Formulas there.
* ``against.py`` -- the model beside an experiment grid's measured rows, with the error: each row in
  its own wire format, at the split it kept with ``--rebalance off``; the rows a fixed split cannot
  predict (``--rebalance on`` on a slow link, the batch split) are listed with the reason.

Columns of ``--out``: arch, batch (the batch size), split, medium, bandwidth_MBps, latency_ms, nodes
(the participants: ``--workers`` + 1), step_s, comm_s, conv_s, comp_s, speedup (the contract), then fuse,
label, wire, norm, devices, bytes_sent, bytes_recv, solo_step_s (a CSV written before ``wire`` existed is
fp32). ``split`` and ``fuse`` are the main job's options, and the simulator predicts every ``--fuse`` with
every ``--split``: the paper's split is fuse off, split kernels.

What it said here (one ``--measure`` of 300:1000 at batch size 64 on one core of the development VM,
10.5 s a step alone, copied to every node; 1 ms a message; rerun it for your devices):

* **The paper's shape.** At the paper's 5 MB/s no node count pays on a CPU this fast: 2 nodes take
  48.9 s a step with the paper's split (0.22x), and it only gets worse (32 nodes 0.03x, 128 0.01x).
  Their devices ran Matlab in 2017; with every device 30 times slower (``--slowdown 30``) the
  figures' shape appears at 5 MB/s Wi-Fi: 1.78x at 4 nodes, back under 1 by 32 (0.90x), 0.28x at
  128. At 125 MB/s on this CPU: 1.65x at 4 nodes, 0.76x at 32, 0.23x at 128.
* **Where tinyconv's fused split changes the conclusion -- and where not.** It halves the bytes of a
  step with 2 nodes (107 against 214 MB: pooled maps, a quarter of the size, travel instead of the
  conv outputs and their gradients), so 2 nodes break even at 22 MB/s instead of 48, and the best
  speedup rises by a third (125 MB/s: 2.18x against 1.65x at 4 nodes; at 30x slower and 5 MB/s,
  2.38x at 8 against 1.78x at 4). It does not move the large-N conclusion: what grows with N is
  the input x sent to every worker and a whole partial dX sent back by every worker, the same in
  both splits (2 x 19.7 MB per worker for conv2), so at 32 nodes it moves 1399 against 1581 MB a
  step and at 128 nodes 5338 against 5439: both fall together (125 MB/s: 0.87x and 0.76x at 32,
  0.24x and 0.23x at 128). Only a split that does not send all of x to everyone, or a medium that
  broadcasts it, would change that. The split by input channels moves more still beyond two
  workers, which is why tinyconv uses it only with every worker on the master's host.
* **Wi-Fi against Ethernet.** The shared channel costs the paper's split up to 19 % (8 nodes, 5
  MB/s), the fused split at most 6 %, the split by channels up to 96 %: full duplex saves as much as
  a split sends both ways in the same op. In the fused split's ops one direction dominates (x out
  in the forward, dX back in the backward), and the master's NIC carries it one worker after
  another on either medium.
* **Against measured runs.** 50:500 at batch 64 over a 20 MB/s veth pair
  (``benchmarks/throttled_link.py``): step time predicted within 0.1 % (fused) and 1.7 % (paper's
  split), comm 1.08 s against 1.04 s and 2.79 against 2.91 s; the speedups were 23-26 % high because
  the device file's master alone (1.19 s) was timed at another load than the grid's (0.94 s). On
  loopback, with other jobs on the 2 cores, the model said 1.75x and the runs 0.91x: it assumes a
  core for each participant.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv simulate ARGS``; 0 on success, 2 on bad input (one line on stderr)."""
    from tinyconv.lab.simulate.parser import parse
    from tinyconv.options import UsageError, config_text

    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"tinyconv simulate: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config_text(vars(args)))
        return 0
    # --measure times one paper-style CPU: one BLAS thread, which BLAS reads once, when numpy loads
    if args.measure and "numpy" not in sys.modules:
        for var in BLAS_THREADS:
            os.environ[var] = "1"
    from tinyconv.lab.simulate.command import run

    return run(args)
