"""The hybrid's cut through the network: its convolutional part, shared by images, and the classifier.

    conv part   conv1 -> ReLU -> norm -> pool -> conv2 -> ReLU -> norm -> pool     every layer before the
                x (n, C, H, W) -> features (n, F), F = C2 H' W' (the last pool's       first Linear, on each
                output, flattened)                                                   participant's slice
    classifier  fc: features (N, F) -> logits (N, classes), the softmax loss        the master, whole batch

The master's classifier backward over the whole batch gives dL/dfeatures (N, F) with the mean loss's
1/N already in it, so no slice rescales (data parallelism's do, ``replica.py``): a slice's conv
gradient is its part of dL/dW_conv and the master sums them::

    dL/dW_conv = sum_i  sum_{n in slice i} (dL/dfeatures_n) (dfeatures_n / dW_conv)

The master and every worker run the same functions here, so the numbers of a hybrid step do
not depend on who computed which images.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinyconv.distributed.calibrate import median_seconds
from tinyconv.distributed.replica.replica import keeping_statistics
from tinyconv.layers import Conv2D, Linear
from tinyconv.model import Network


def cut(net: Network) -> int:
    """The index of the network's first Linear layer: the conv part is every layer before it.
    ValueError for a network without one, or with a convolution after it."""
    first = next((i for i, layer in enumerate(net.layers) if isinstance(layer, Linear)), None)
    if first is None or first == 0 or any(isinstance(layer, Conv2D) for layer in net.layers[first:]):
        raise ValueError("the hybrid split needs convolutions followed by a fully connected classifier "
                         f"(the paper's network); got {[layer.kind for layer in net.layers]}")  # fmt: skip
    return first


def conv_part(net: Network) -> Network:
    """The layers before the classifier as a network of their own (the same layer objects: their
    parameters, grads and caches are ``net``'s)."""
    return Network(net.backend, net.layers[: cut(net)])


def classifier(net: Network) -> Network:
    """The classifier's layers (from the first Linear on) as a network of their own, with the loss."""
    return Network(net.backend, net.layers[cut(net) :])


def feature_shape(net: Network, image_size: int) -> tuple[int, int, int]:
    """(C2, H', W'): what the conv part makes of one image of ``image_size`` pixels square."""
    first = next(layer for layer in net.layers if isinstance(layer, Conv2D))
    shape: tuple[int, ...] = (1, first.in_channels, image_size, image_size)
    for layer in net.layers[: cut(net)]:
        shape = layer.output_shape(shape)
    _, c, h, w = shape
    return c, h, w


def forward_features(conv: Network, x: Any, seen: dict | None = None) -> np.ndarray:
    """The conv part's forward (training mode: its caches kept for the backward) on x (n, C, H, W):
    the features (n, F) on the host, float32; its batch norms' running statistics left as the slice's
    (``replica.keeping_statistics``). ``seen``: ``Network.forward``'s."""
    be = conv.backend
    with keeping_statistics(conv):
        y = be.to_numpy(conv.forward(be.asarray(x), training=True, seen=seen))
    return np.ascontiguousarray(y.reshape(len(y), -1), dtype=np.float32)


def backward_features(
    conv: Network, dfeatures: np.ndarray, shape: tuple[int, int, int], seen: dict | None = None
) -> None:
    """The conv part's backward from dL/dfeatures (n, F) of its last forward, ``shape`` = (C2, H', W'):
    fills every conv-part layer's grads with the slice's part of the batch's gradient (``seen``: as
    ``Network.backward``'s)."""
    n = len(dfeatures)
    if dfeatures.shape != (n, math.prod(shape)):
        raise ValueError(f"dfeatures must be (n, {math.prod(shape)}), got {tuple(dfeatures.shape)}")
    conv.backward(conv.backend.asarray(np.ascontiguousarray(dfeatures.reshape(n, *shape), dtype=np.float32)), seen)


def time_conv_part(net: Network, spec: dict[str, Any], batch: int, repeats: int) -> float:
    """Seconds of one forward + backward of ``net``'s conv part (``net`` built from ``spec``) on ``batch``
    random images."""
    rng = np.random.default_rng(0)
    size = spec["image_size"]
    x = rng.standard_normal((batch, spec["in_channels"], size, size)).astype(np.float32)
    conv, shape = conv_part(net), feature_shape(net, size)
    d = rng.standard_normal((batch, math.prod(shape))).astype(np.float32) / np.float32(batch)

    def step() -> None:
        forward_features(conv, x)
        backward_features(conv, d, shape)

    return median_seconds(step, net.backend, repeats)
