#!/usr/bin/env python3
"""A lecture demo of the paper's idea in one screen: split a convolution by kernels.

    python examples/split_a_convolution.py

Three in-process workers, one of them made 3x slower (``slowdown``, a testing aid
that emulates a slower device), share the 32 kernels of one convolution with the
master. The split starts from the paper's eq. 1 on calibrated times, and the
rebalancer then follows the measured step times. Whatever the split, the output
and the gradients equal the unsplit convolution's to float32 round-off.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from tinyconv.distributed import ShardedConv  # noqa: E402
from tinyconv.layers import Conv2D  # noqa: E402
from tinyconv.model import Network  # noqa: E402
from tinyconv.plugins import get_backend, get_transport  # noqa: E402
from tinyconv.shard.balance import kernel_counts, speed_weights  # noqa: E402
from tinyconv.worker import ConvWorker  # noqa: E402


def main() -> None:
    print(
        "eq. 1: devices taking 1 s, 2 s and 4 s for a layer get weights",
        [round(w, 3) for w in speed_weights([1.0, 2.0, 4.0])],
        "-> of 32 kernels:",
        kernel_counts(speed_weights([1.0, 2.0, 4.0]), 32),
    )

    be = get_backend("numpy")
    rng = np.random.default_rng(0)
    conv = Conv2D(be, 16, 32, 5, padding=2)
    conv.params["w"] = (rng.standard_normal((32, 16, 5, 5)) * 0.1).astype(np.float32)
    x = rng.standard_normal((32, 16, 16, 16)).astype(np.float32)
    dy = rng.standard_normal((32, 32, 16, 16)).astype(np.float32)

    y_ref = conv.forward(x)
    dx_ref = conv.backward(dy)
    dw_ref = conv.grads["w"]

    slowdowns = [1.0, 1.0, 3.0]
    transport = get_transport("inproc", handler_factory=lambda i: ConvWorker(get_backend("numpy"), slowdowns[i]))
    with transport:
        workers = transport.start(len(slowdowns), timeout=30)
        shards = ShardedConv(transport, workers, be, master_share="auto")
        shards.attach(Network(be, [conv], {}))  # a one-layer network: just this convolution
        print(f"\nparticipants: {shards.participants} (worker2 is 3x slower)")
        for step in range(12):
            y = conv.forward(x)
            dx = conv.backward(dy)
            report = shards.end_step()
            print(
                f"step {step:2d}: kernels {report['shares']['conv1']}  "
                f"compute s {[round(t, 3) for t in report['participant_conv_s']]}"
            )
        print("\nsplit result vs unsplit, max |difference| / max |value| (float32 round-off is ~1e-7):")
        for name, got, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", conv.grads["w"], dw_ref)):
            print(f"  {name:2s} {np.abs(got - ref).max() / np.abs(ref).max():.1e}")


if __name__ == "__main__":
    main()
