"""The network runs a ReLU directly followed by an LRN as one backend op, relu_lrn_forward, with the
same numbers as the two layers one by one (the op itself is checked by the conformance suite)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from backends.numpy_backend import NumpyBackend
from tinyconv.layers import Conv2D, LocalResponseNorm, ReLU
from tinyconv.model import Network, paper_net


class CountingBackend(NumpyBackend):
    """The reference, counting the ops a network calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if name.endswith(("_forward", "_backward")):
            super().__getattribute__("calls")[name] += 1
        return attr


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 3, 16, 16), dtype=np.float32), rng.integers(0, 10, 2)


def test_the_paper_net_runs_each_relu_and_lrn_as_one_op():
    be = CountingBackend()
    net = paper_net("4:6", be, image_size=16)
    assert [tuple(layer.name for layer in run) for run in net.runs()] == [
        ("conv1",),
        ("relu1", "lrn1"),
        ("pool1",),
        ("conv2",),
        ("relu2", "lrn2"),
        ("pool2",),
        ("fc1",),
    ]
    net.train_step(*batch())
    assert be.calls["relu_lrn_forward"] == be.calls["relu_lrn_backward"] == 2
    # the default relu_lrn_* is the plain ops' composition: each runs once per fused pair
    assert be.calls["relu_forward"] == be.calls["lrn_forward"] == be.calls["lrn_backward"] == 2


def grads(net: Network) -> dict[str, np.ndarray]:
    return {name: layer.grads[p].copy() for name, layer, p in net.named_params()}


def test_the_fused_pair_gives_the_numbers_of_the_layers_one_by_one():
    x, labels = batch(1)
    net = paper_net("4:6", "numpy", image_size=16)
    loss = net.train_step(x, labels)
    fused = grads(net)
    # the same network, its layers run one at a time by hand
    h = x
    for layer in net.layers:
        h = layer.forward(h, training=True)
    ref_loss, dlogits = net.loss_fn(h, labels)
    d = dlogits
    for layer in reversed(net.layers):
        d = layer.backward(d)
        if d is None:
            break
    assert loss == ref_loss
    by_hand = grads(net)
    assert all(np.array_equal(by_hand[k], fused[k]) for k in fused)
    # the fused forward, then the layers' backwards by hand: the LRN's runs the pair's, the ReLU's passes through
    net.forward(x, training=True)
    d = dlogits
    for layer in reversed(net.layers):
        d = layer.backward(d)
        if d is None:
            break
    assert all(np.array_equal(v, by_hand[k]) for k, v in grads(net).items())


def test_only_a_plain_relu_right_before_a_plain_lrn_is_fused():
    be = NumpyBackend()

    class LeakyReLU(ReLU):  # a subclass may compute something else: it runs as itself
        pass

    conv = Conv2D(be, 3, 4, 3, padding=1, need_dx=False, rng=np.random.default_rng(0))
    layers = [conv, ReLU(be), ReLU(be), LocalResponseNorm(be), LeakyReLU(be), LocalResponseNorm(be)]
    net = Network(be, layers)
    assert [len(run) for run in net.runs()] == [1, 1, 2, 1, 1]
    assert [len(run) for run in paper_net("4:6", be, norm="batch", image_size=16).runs()] == [1] * 9
