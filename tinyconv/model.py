"""The paper's network as a preset, and the small Network container that runs it.

    conv 5x5 -> ReLU -> norm -> max pool /2 -> conv 5x5 -> ReLU -> norm -> max pool /2
    -> fully connected -> softmax loss

Architectures are named by their kernel counts ``C1:C2``; the paper's four are
``50:500``, ``150:800``, ``300:1000`` and ``500:1500``, and any other ``C1:C2`` works.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from backends import as_backend
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
    relu_lrn_forward,
    relu_then_lrn,
)

PAPER_ARCHS = ("50:500", "150:800", "300:1000", "500:1500")
NORMS = ("lrn", "batch", "none")


def parse_arch(arch: str | tuple[int, int]) -> tuple[int, int]:
    """'150:800' (or (150, 800)) -> (150, 800), with a clear error for anything else."""
    if isinstance(arch, tuple) and len(arch) == 2 and all(isinstance(c, int) and c >= 1 for c in arch):
        return arch
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", arch) if isinstance(arch, str) else None
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(
            f"architecture {arch!r} is not of the form C1:C2 with positive kernel counts; "
            f"the paper's are {', '.join(PAPER_ARCHS)}"
        )
    return int(m.group(1)), int(m.group(2))


class Network:
    """An ordered list of layers and the softmax cross-entropy loss after them. Layers without a name get one
    by kind and order ("conv1", "relu1", "lrn1", "pool1", "conv2", ..., "fc1"), which keys their parameters
    ("conv1.w") in optimisers and checkpoints wherever they stand in the list."""

    def __init__(self, backend: Backend, layers: list[Layer], config: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.layers = layers
        self.loss_fn = SoftmaxCrossEntropy(backend)
        self.config = config or {}
        seen: Counter[str] = Counter()
        for layer in layers:
            seen[layer.kind] += 1
            layer.name = layer.name or f"{layer.kind}{seen[layer.kind]}"
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be unique, got {names}")

    def forward(self, x: Array, training: bool = False, seen: dict[str, np.ndarray] | None = None) -> Array:
        """x (N, C, H, W) backend array -> logits (N, classes). ``training=True`` uses and updates
        batch statistics (batch norm); the default is inference. ``seen`` gets each convolution's and LRN's
        input (its run's: a ReLU's before it) on the host, by layer name, for the checks of their backward
        (distributed/replica/probe.py, inner_ops.py): numpy's own arrays, not copied (no op writes its inputs)."""
        for run in self.runs():
            if seen is not None and (isinstance(run[0], Conv2D) or isinstance(run[-1], LocalResponseNorm)):
                seen[run[-1].name] = np.asarray(self.backend.to_numpy(x), dtype=np.float32)
            x = relu_lrn_forward(*run, x) if len(run) == 2 else run[0].forward(x, training)
        return x

    def predict(self, x: Array) -> Array:
        """Inference, x (N, C, H, W) -> logits (N, classes): ``forward(x)``, dropping each layer's cache (a conv's
        im2col columns: tens to hundreds of MB) once it is done, for the next layer to reuse. No backward follows."""
        for run in self.runs():
            x = relu_lrn_forward(*run, x) if len(run) == 2 else run[0].forward(x, training=False)
            for layer in run:
                layer.cache = None
        return x

    def backward(self, dlogits: Array, seen: dict[str, np.ndarray] | None = None) -> None:
        """Backprop dloss/dlogits through every layer, filling each layer's grads. ``seen`` gets, on the host,
        the gradients each convolution or norm got and gave, by name ('bn1', 'bn1.dx'; as ``forward``'s; an LRN
        after a ReLU gives the pair's)."""
        d = dlogits
        for layer in reversed(self.layers):
            if seen is not None and isinstance(layer, (Conv2D, BatchNorm2D, LocalResponseNorm)):
                seen[layer.name] = np.asarray(self.backend.to_numpy(d), dtype=np.float32)
            d = layer.backward(d)
            if seen is not None and d is not None and isinstance(layer, (Conv2D, BatchNorm2D, LocalResponseNorm)):
                seen[f"{layer.name}.dx"] = np.asarray(self.backend.to_numpy(d), dtype=np.float32)
            if d is None:  # the first conv does not compute dX
                break

    def runs(self) -> list[tuple[Layer, ...]]:
        """The layers in the order the forward runs them, a ReLU directly followed by an LRN as one pair
        (``relu_lrn_forward``, see layers.py). Read at each call: a cluster's attach and detach change it."""
        runs: list[tuple[Layer, ...]] = []
        for layer in self.layers:
            if runs and len(runs[-1]) == 1 and relu_then_lrn(runs[-1][0], layer):
                runs[-1] = (runs[-1][0], layer)
            else:
                runs.append((layer,))
        return runs

    def training_loss(self, smoothing: float = 0.0) -> SoftmaxCrossEntropy:
        """``loss_fn``, or with ``smoothing`` > 0 the cross-entropy against the label-smoothed target."""
        return SoftmaxCrossEntropy(self.backend, smoothing) if smoothing else self.loss_fn

    def train_step(self, x: Array | np.ndarray, labels: np.ndarray) -> float:
        """Forward in training mode, the loss, backward: every layer's grads are filled; returns the loss.
        ``x`` may be a host numpy array; the optimiser's ``step()`` then applies the grads."""
        if isinstance(x, np.ndarray):
            x = self.backend.asarray(x)
        loss, dlogits = self.loss_fn(self.forward(x, training=True), np.asarray(labels))
        self.backward(dlogits)
        return loss

    def leaves(self) -> list[Layer]:
        """The layers that hold the parameters and buffers, in order: a layer made of others
        (a convolution and the layers after it, computed in shards) stands for them."""
        return [leaf for layer in self.layers for leaf in layer.leaves()]

    def named_params(self) -> Iterator[tuple[str, Layer, str]]:
        """('conv1.w', layer, 'w') for every trainable parameter, in a fixed order."""
        for layer in self.leaves():
            for name in layer.params:
                yield f"{layer.name}.{name}", layer, name

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of every parameter and buffer, keyed '<layer name>.<name>'."""
        out = {}
        for layer in self.leaves():
            for name, arr in {**layer.params, **layer.buffers}.items():
                out[f"{layer.name}.{name}"] = self.backend.to_numpy(arr).copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for layer in self.leaves():
            for table in (layer.params, layer.buffers):
                for name, arr in table.items():
                    key = f"{layer.name}.{name}"
                    if key not in state:
                        raise ValueError(f"state has no entry {key!r}: was it saved from another architecture?")
                    if tuple(state[key].shape) != tuple(arr.shape):
                        raise ValueError(
                            f"state entry {key!r} has shape {state[key].shape}, the network expects "
                            f"{tuple(arr.shape)}: was it saved from another architecture?"
                        )
                    table[name] = self.backend.asarray(state[key].astype(np.float32))

    def num_params(self) -> int:
        return sum(int(np.prod(a.shape)) for layer in self.leaves() for a in layer.params.values())

    def __repr__(self) -> str:
        return "Network(\n  " + "\n  ".join(map(repr, self.layers)) + "\n)"


def paper_net(
    arch: str | tuple[int, int] = "50:500",
    backend: str | Backend = "numpy",
    norm: str = "lrn",
    seed: int = 0,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    pool_kernel: int = 3,
) -> Network:
    """The paper's network with kernel counts ``arch`` ("C1:C2"), He-initialised from ``seed``.

    ``backend`` is a Backend or a registered name. Convolutions are 5x5 with padding 2 (same
    size); pools halve the size (``pool_kernel`` 3: overlapping 3x3 stride 2 pad 1, as
    cuda-convnet and Caffe's CIFAR nets; 2: 2x2 stride 2). Weights are drawn on the host
    from one numpy Generator in a fixed order, so a seed gives the same initial weights on
    every backend and with any number of workers.
    """
    c1, c2 = parse_arch(arch)
    backend = as_backend(backend)
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")
    if pool_kernel not in (2, 3):
        raise ValueError(f"pool_kernel must be 2 or 3, got {pool_kernel}")
    pool_pad = 1 if pool_kernel == 3 else 0
    rng = np.random.default_rng(seed)
    size = image_size
    layers: list[Layer] = []
    for i, (cin, cout) in enumerate(((in_channels, c1), (c1, c2))):
        layers.append(Conv2D(backend, cin, cout, 5, stride=1, padding=2, need_dx=i > 0, rng=rng))
        layers.append(ReLU(backend))
        if norm == "lrn":  # k = 2, AlexNet's, as this preset has always had (torch's default is 1)
            layers.append(LocalResponseNorm(backend, k=2.0))
        elif norm == "batch":
            layers.append(BatchNorm2D(backend, cout))
        layers.append(MaxPool2D(backend, pool_kernel, 2, pool_pad))
        size = (size + 2 * pool_pad - pool_kernel) // 2 + 1
    classifier = Linear(backend, c2 * size * size, num_classes, rng=rng)
    # the classifier gets the variance-1/fan_in scale: no ReLU follows it
    classifier.params["w"] = backend.asarray(backend.to_numpy(classifier.params["w"]) / np.float32(np.sqrt(2.0)))
    layers.append(classifier)
    config = {"arch": f"{c1}:{c2}", "conv1": c1, "conv2": c2, "norm": norm, "seed": seed,
              "num_classes": num_classes, "pool_kernel": pool_kernel}  # fmt: skip
    return Network(backend, layers, config)
