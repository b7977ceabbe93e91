"""SGD with momentum and weight decay, on the backend (velocities live on the device).

torch.optim.SGD's update, so runs compare 1:1 (dampening 0, no Nesterov)::

    g = grad + weight_decay * w
    v = momentum * v + g            (v starts at 0, so the first v is g, as torch's buffer)
    w = w - lr * v

One difference, on purpose: weight decay applies only to the weights of convolutions and fully
connected layers (each layer's ``decay`` set), where torch decays every parameter it is given; torch
gives the same numbers with two parameter groups (``benchmarks/bench_train_step.py``).
"""

from __future__ import annotations

import numpy as np

from tinyconv.model import Network


class SGD:
    """``step()`` applies the last backward's grads, finding the parameters through ``net.named_params()``
    each time: a layer ``tinyconv.distribute`` swaps for a sharded one has the same arrays, names too.

    ``layer_lr`` gives some layers, by name, a factor on the rate: ``{"fc1": 0.1}`` steps the classifier
    by ``0.1 * lr * v`` with the same v, as torch's per-group ``lr``. The paper's classifier reads 32,000
    features, so one step moves the logits by about lr * |x|^2 and the first steps' loss jumps to 30-40
    at the full rate (``benchmarks/bench_init.py``).
    """

    def __init__(
        self,
        net: Network,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        layer_lr: dict[str, float] | None = None,
    ) -> None:
        self.layer_lr = dict(layer_lr or {})
        names = [layer.name for layer in net.leaves() if layer.params]
        for layer_name in self.layer_lr:
            if layer_name not in names:
                raise ValueError(
                    f"layer_lr names {layer_name!r}, which has no parameters; the layers are {', '.join(names)}"
                )
        factors = [(f"layer_lr[{k!r}]", v) for k, v in self.layer_lr.items()]
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay), *factors):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        self.net, self.lr, self.momentum, self.weight_decay = net, lr, momentum, weight_decay
        be = net.backend
        self.velocity = {key: be.zeros(tuple(layer.params[name].shape)) for key, layer, name in net.named_params()}

    def step(self) -> None:
        """One update with learning rate ``self.lr`` from the grads the last backward left."""
        be = self.net.backend
        for key, layer, name in self.net.named_params():
            if name not in layer.grads:
                raise RuntimeError(f"no gradient for parameter {key}: call backward (or net.train_step) before step")
            wd = self.weight_decay if name in layer.decay else 0.0
            lr = self.lr * self.layer_lr.get(layer.name, 1.0)
            be.sgd_update(layer.params[name], layer.grads[name], self.velocity[key], lr, self.momentum, wd)

    def state_dict(self) -> dict[str, np.ndarray]:
        be = self.net.backend
        return {key: be.to_numpy(v).copy() for key, v in self.velocity.items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for key, v in self.velocity.items():
            got = state.get(key)
            if got is None or got.shape != tuple(v.shape):
                found = "nothing" if got is None else f"shape {got.shape}"
                raise ValueError(f"the optimizer state has {found} for the velocity of {key}: it is damaged")
            self.velocity[key] = self.net.backend.asarray(got.astype(np.float32))
