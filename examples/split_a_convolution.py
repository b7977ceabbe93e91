#!/usr/bin/env python3
"""A lecture demo of the paper's idea in one screen: split a convolution by kernels.

    python examples/split_a_convolution.py

Three in-process workers, one of them made 3x slower (``slowdown``, a testing aid that
emulates a slower device), share the 96 kernels of one convolution with the master. As
in the paper, the cluster first times every participant on the layer's own shape and
splits the kernels by eq. 1 (``w_i`` proportional to ``1/t_i``: printed first on made-up
times, then on the measured ones), so the slow worker gets about a third of a fast one's
share, and keeps that split for every step. Whatever the split, the output and the
gradients equal the unsplit convolution's to float32 round-off.

The step times printed show eq. 1's limit: every participant also repeats work that does
not shrink with its share (the im2col of the whole input, the col2im of the whole dX), three
times slower on the slow worker, so its step stays the longest. tinyconv's rebalancer (on in
the main job, ``--rebalance``) fits that fixed cost and moves kernels to even the times out;
it is off here because the four participants are threads sharing this machine's cores, so
their step times mostly measure that sharing -- across machines they measure the devices.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import tinyconv as tc  # noqa: E402
from tinyconv.distributed.protocol import VERSION  # noqa: E402
from tinyconv.distributed.shard.balance import apportion, speed_weights  # noqa: E402
from tinyconv.distributed.worker.handler import Worker  # noqa: E402

BATCH, C_IN, KERNELS, SIZE, STEPS = 16, 32, 96, 16, 12


def main() -> None:
    weights = speed_weights([1.0, 2.0, 4.0])
    print(
        "eq. 1: devices taking 1 s, 2 s and 4 s for a layer get weights",
        [round(w, 3) for w in weights],
        "-> of 32 kernels:",
        apportion(weights, 32),
    )

    be = tc.get_backend("numpy")
    rng = np.random.default_rng(0)
    conv = tc.Conv2D(be, C_IN, KERNELS, 5, padding=2, rng=rng)
    net = tc.Network(be, [conv])  # a one-layer network: just this convolution
    x = rng.standard_normal((BATCH, C_IN, SIZE, SIZE)).astype(np.float32)
    dy = rng.standard_normal((BATCH, KERNELS, SIZE, SIZE)).astype(np.float32)
    y_ref, dx_ref = conv.forward(x), conv.backward(dy)
    dw_ref = conv.grads["w"]

    slowdowns = [1.0, 1.0, 3.0]
    make = lambda i: Worker(tc.get_backend("numpy"), slowdown=slowdowns[i])  # noqa: E731
    with tc.get_transport("inproc", handler_factory=make, protocol=VERSION) as transport:
        workers = transport.start(len(slowdowns), timeout=30)
        cluster = tc.Cluster(transport, workers, be, split="kernels", rebalance=False)  # the paper's fixed split
        calibration = cluster.calibrate(net, batch_size=BATCH, image_size=SIZE)  # attaches: the conv is now sharded
        block = net.layers[0]
        times = calibration["times"][block.name]
        print(f"\nparticipants: {cluster.participants} (worker2 is 3x slower)")
        print(f"calibrated seconds (forward + backward): {[round(t, 4) for t in times]}")
        print(f"eq. 1 on them -> kernels {calibration['shares'][block.name]}")
        for step in range(STEPS):
            y, dx = block.forward(x), block.backward(dy)
            record = cluster.last_step
            compute = [round(t, 3) for t in record["participant_conv_s"]]
            print(f"step {step:2d}: kernels {record['shares'][block.name]}  compute s {compute}")
        print("\nsplit result vs unsplit, max |difference| / max |value| (float32 round-off is ~1e-7):")
        for name, got, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", block.grads["w"], dw_ref)):
            print(f"  {name:2s} {np.abs(got - ref).max() / np.abs(ref).max():.1e}")


if __name__ == "__main__":
    main()
