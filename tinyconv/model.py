"""The paper's network as a preset, and the small Network container that runs it.

    conv 5x5 -> ReLU -> norm -> max pool /2 -> conv 5x5 -> ReLU -> norm -> max pool /2
    -> fully connected -> softmax loss

Architectures are named by their kernel counts ``C1:C2``; the paper's four are
``50:500``, ``150:800``, ``300:1000`` and ``500:1500``, and any other ``C1:C2`` works.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.layers import (
    BatchNorm2D,
    Conv2D,
    Layer,
    Linear,
    LocalResponseNorm,
    MaxPool2D,
    ReLU,
    SoftmaxCrossEntropy,
)

PAPER_ARCHS = ("50:500", "150:800", "300:1000", "500:1500")
NORMS = ("lrn", "batch", "none")


def parse_arch(arch: str) -> tuple[int, int]:
    """'150:800' -> (150, 800), with a clear error for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", arch)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(
            f"architecture {arch!r} is not of the form C1:C2 with positive kernel counts; "
            f"the paper's are {', '.join(PAPER_ARCHS)}"
        )
    return int(m.group(1)), int(m.group(2))


class Network:
    """An ordered list of layers plus the loss. Runs forward, backward, and holds state."""

    def __init__(self, backend: Backend, layers: list[Layer], config: dict[str, Any]) -> None:
        self.backend = backend
        self.layers = layers
        self.loss_fn = SoftmaxCrossEntropy(backend)
        self.config = config

    def forward(self, x: Array, training: bool = True) -> Array:
        """x (N, 3, 32, 32) backend array -> logits (N, classes)."""
        for layer in self.layers:
            if not layer.fused:  # a fused layer was computed inside the conv before it
                x = layer.forward(x, training)
        return x

    def backward(self, dlogits: Array) -> None:
        """Backprop dloss/dlogits through every layer, filling each layer's grads."""
        d = dlogits
        for layer in reversed(self.layers):
            if layer.fused:
                continue
            d = layer.backward(d)
            if d is None:  # the first conv does not compute dX
                break

    def train_step_grads(self, x: Array, labels: np.ndarray) -> tuple[float, Array]:
        """Forward in training mode, loss, backward. Returns (loss, logits)."""
        logits = self.forward(x, training=True)
        loss, dlogits = self.loss_fn(logits, labels)
        self.backward(dlogits)
        return loss, logits

    def named_params(self) -> Iterator[tuple[str, Layer, str]]:
        """('3.w', layer, 'w') for every trainable parameter, in a fixed order."""
        for i, layer in enumerate(self.layers):
            for name in layer.params:
                yield f"{i}.{name}", layer, name

    def conv_layers(self) -> list[Conv2D]:
        return [layer for layer in self.layers if isinstance(layer, Conv2D)]

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of every parameter and buffer, keyed '<layer index>.<name>'."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name, arr in {**layer.params, **layer.buffers}.items():
                out[f"{i}.{name}"] = self.backend.to_numpy(arr).copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for i, layer in enumerate(self.layers):
            for table in (layer.params, layer.buffers):
                for name, arr in table.items():
                    key = f"{i}.{name}"
                    if key not in state:
                        raise ValueError(f"state has no entry {key!r}: was it saved from another architecture?")
                    if tuple(state[key].shape) != tuple(arr.shape):
                        raise ValueError(
                            f"state entry {key!r} has shape {state[key].shape}, the network expects "
                            f"{tuple(arr.shape)}: was it saved from another architecture?"
                        )
                    table[name] = self.backend.asarray(state[key].astype(np.float32))

    def num_params(self) -> int:
        return sum(int(np.prod(a.shape)) for layer in self.layers for a in layer.params.values())

    def __repr__(self) -> str:
        return "Network(\n  " + "\n  ".join(map(repr, self.layers)) + "\n)"


def he_init(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """He (Kaiming) normal initialisation: N(0, 2 / fan_in), float32."""
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def paper_net(
    backend: Backend,
    conv1: int = 50,
    conv2: int = 500,
    norm: str = "lrn",
    seed: int = 0,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    pool_kernel: int = 3,
) -> Network:
    """Build the paper's network with He-initialised weights drawn from ``seed``.

    Convolutions are 5x5 with padding 2 (same size); pools halve the size
    (``pool_kernel`` 3: overlapping 3x3 stride 2 pad 1, as cuda-convnet and
    Caffe's CIFAR nets; 2: 2x2 stride 2). Weights are drawn on the host from one
    numpy Generator in a fixed order, so a seed gives the same initial weights
    on every backend and with any number of workers.
    """
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")
    if pool_kernel not in (2, 3):
        raise ValueError(f"pool_kernel must be 2 or 3, got {pool_kernel}")
    pool_pad = 1 if pool_kernel == 3 else 0

    def norm_layer(channels: int) -> list[Layer]:
        if norm == "lrn":
            return [LocalResponseNorm(backend)]
        if norm == "batch":
            return [BatchNorm2D(backend, channels)]
        return []

    size = image_size
    layers: list[Layer] = []
    for i, (cin, cout) in enumerate(((in_channels, conv1), (conv1, conv2))):
        layers.append(Conv2D(backend, cin, cout, 5, stride=1, padding=2, need_dx=i > 0))
        layers.append(ReLU(backend))
        layers += norm_layer(cout)
        layers.append(MaxPool2D(backend, pool_kernel, 2, pool_pad))
        size = (size + 2 * pool_pad - pool_kernel) // 2 + 1
    features = conv2 * size * size
    layers.append(Linear(backend, features, num_classes))

    rng = np.random.default_rng(seed)
    for layer in layers:
        if isinstance(layer, Conv2D):
            fan_in = layer.in_channels * layer.kernel * layer.kernel
            layer.params["w"] = backend.asarray(he_init(rng, (layer.out_channels, layer.in_channels, 5, 5), fan_in))
        elif isinstance(layer, Linear):
            # the classifier gets the variance-1/fan_in scale: no ReLU follows it
            w = he_init(rng, (num_classes, features), features) / np.float32(np.sqrt(2.0))
            layer.params["w"] = backend.asarray(w)

    config = {
        "arch": f"{conv1}:{conv2}",
        "conv1": conv1,
        "conv2": conv2,
        "norm": norm,
        "seed": seed,
        "num_classes": num_classes,
        "pool_kernel": pool_kernel,
    }
    return Network(backend, layers, config)
