#!/usr/bin/env python3
"""A lecture demo: every backward in tinyconv is hand-written, and here is the proof.

    python examples/backprop_by_hand.py

For each layer of the paper's network it compares the analytic gradients (the
hand-written backward) with centred finite differences in float64, then shows
the classic trap: a local response norm backward that forgets that y_i depends
on its neighbours x_j, which a weak test lets pass and this check does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from backends.numpy_backend import NumpyBackend  # noqa: E402
from tinyconv.gradcheck import check_layer, check_loss, check_network, numeric_grad, rel_error  # noqa: E402
from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm, MaxPool2D, ReLU  # noqa: E402
from tinyconv.model import paper_net  # noqa: E402


def main() -> None:
    be = NumpyBackend()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 9, 9))  # odd sizes on purpose
    conv = Conv2D(be, 4, 5, 3, stride=2, padding=1)
    conv.params["w"] = rng.standard_normal((5, 4, 3, 3)).astype(np.float32)
    layers = [
        conv,
        ReLU(be),
        LocalResponseNorm(be, size=3, alpha=0.5),  # a large alpha makes the cross-channel term matter
        BatchNorm2D(be, 4),
        MaxPool2D(be, 3, 2, 1),  # overlapping windows
        Linear(be, 4 * 9 * 9, 3),
    ]
    layers[-1].params["w"] = rng.standard_normal((3, 4 * 9 * 9)).astype(np.float32) * 0.1
    print("relative error of each gradient (analytic vs numeric; below 1e-7 means right):")
    for layer in layers:
        errors = check_layer(layer, x)
        print(f"  {layer!r:55s} " + "  ".join(f"d{k}: {v:.1e}" for k, v in errors.items()))
    print(f"  {'SoftmaxCrossEntropy':55s} dlogits: {check_loss(rng.standard_normal((4, 10)), np.arange(4)):.1e}")

    net = paper_net("3:4", be, "lrn", seed=0, image_size=12)
    errors = check_network(net, rng.standard_normal((2, 3, 12, 12)), np.array([1, 7]))
    print(f"  whole network, d loss / d w:  worst {max(errors.values()):.1e}")

    # the trap: keep only the diagonal term of the LRN Jacobian
    size, alpha, beta, k = 3, 0.5, 0.75, 2.0
    xl = rng.standard_normal((1, 6, 2, 2))
    y, cache = be.lrn_forward(xl, size, alpha, beta, k)
    dy = rng.standard_normal(y.shape)
    s = cache[2]  # the denominator k + alpha/n * sum x^2
    diagonal_only = dy * s**-beta - 2 * alpha * beta / size * xl * dy * y / s
    numeric = numeric_grad(lambda v: be.lrn_forward(v, size, alpha, beta, k)[0], xl, dy)
    print("\nLRN backward, the trap:")
    print(f"  full Jacobian (tinyconv):   {rel_error(be.lrn_backward(dy, cache), numeric):.1e}")
    print(f"  diagonal term only (wrong): {rel_error(diagonal_only, numeric):.1e}")


if __name__ == "__main__":
    main()
