#!/usr/bin/env python3
"""A lecture demo of the paper's idea in one screen: split a convolution by kernels.

    python examples/split_a_convolution.py

Three in-process workers, one of them made 3x slower (``slowdown``, a testing aid
that emulates a slower device), share the 32 kernels of one convolution with the
master. The split starts equal; the rebalancer then follows the measured step times
(the paper would calibrate once and keep eq. 1's split, printed first). Whatever the
split, the output and the gradients equal the unsplit convolution's to float32 round-off.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import tinyconv as tc  # noqa: E402
from tinyconv.shard.balance import kernel_counts, speed_weights  # noqa: E402
from tinyconv.shard.protocol import VERSION  # noqa: E402
from tinyconv.worker.handler import Worker  # noqa: E402


def main() -> None:
    weights = speed_weights([1.0, 2.0, 4.0])
    print(
        "eq. 1: devices taking 1 s, 2 s and 4 s for a layer get weights",
        [round(w, 3) for w in weights],
        "-> of 32 kernels:",
        kernel_counts(weights, 32),
    )

    be = tc.get_backend("numpy")
    rng = np.random.default_rng(0)
    conv = tc.Conv2D(be, 16, 32, 5, padding=2, rng=rng)
    net = tc.Network(be, [conv])  # a one-layer network: just this convolution
    x = rng.standard_normal((32, 16, 16, 16)).astype(np.float32)
    dy = rng.standard_normal((32, 32, 16, 16)).astype(np.float32)
    y_ref, dx_ref = conv.forward(x), conv.backward(dy)
    dw_ref = conv.grads["w"]

    slowdowns = [1.0, 1.0, 3.0]
    make = lambda i: Worker(tc.get_backend("numpy"), slowdown=slowdowns[i])  # noqa: E731
    with tc.get_transport("inproc", handler_factory=make, protocol=VERSION) as transport:
        cluster = tc.Cluster(transport, transport.start(len(slowdowns), timeout=30), be)
        cluster.attach(net)  # the network's conv is now a ShardedBlock
        block = net.layers[0]
        print(f"\nparticipants: {cluster.participants} (worker2 is 3x slower)")
        for step in range(12):
            y, dx = block.forward(x), block.backward(dy)
            record = cluster.last_step
            compute = [round(t, 3) for t in record["participant_conv_s"]]
            print(f"step {step:2d}: kernels {record['shares']['conv1']}  compute s {compute}")
        print("\nsplit result vs unsplit, max |difference| / max |value| (float32 round-off is ~1e-7):")
        for name, got, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", block.grads["w"], dw_ref)):
            print(f"  {name:2s} {np.abs(got - ref).max() / np.abs(ref).max():.1e}")


if __name__ == "__main__":
    main()
