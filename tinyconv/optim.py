"""SGD with momentum and weight decay, on the backend (velocities live on the device).

PyTorch's semantics, so runs compare 1:1:
    g = grad + weight_decay * w        (decay only on weights, not biases or norm params)
    v = momentum * v + g
    w = w - lr * v
"""

from __future__ import annotations

import numpy as np

from tinyconv.model import Network


class SGD:
    def __init__(self, net: Network, momentum: float = 0.9, weight_decay: float = 5e-4) -> None:
        self.net = net
        self.momentum = momentum
        self.weight_decay = weight_decay
        be = net.backend
        self.velocity = {key: be.zeros(tuple(layer.params[name].shape)) for key, layer, name in net.named_params()}

    def step(self, lr: float) -> None:
        """Apply one update with learning rate ``lr`` from the grads the last backward left."""
        be = self.net.backend
        for key, layer, name in self.net.named_params():
            if name not in layer.grads:
                raise RuntimeError(f"no gradient for parameter {key}: call backward before step")
            wd = self.weight_decay if name in layer.decay else 0.0
            be.sgd_update(layer.params[name], layer.grads[name], self.velocity[key], lr, self.momentum, wd)

    def state_dict(self) -> dict[str, np.ndarray]:
        be = self.net.backend
        return {key: be.to_numpy(v).copy() for key, v in self.velocity.items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        be = self.net.backend
        for key in self.velocity:
            if key not in state:
                raise ValueError(f"optimizer state has no velocity for {key!r}")
            self.velocity[key] = be.asarray(state[key].astype(np.float32))
