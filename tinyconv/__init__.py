"""tinyconv: a small, readable CNN framework whose convolutions are split across machines.

In a shell or a notebook::

    import tinyconv as tc
    net = tc.paper_net("50:500", backend="numpy")      # the paper's network, He-initialised from seed 0
    opt = tc.SGD(net, lr=0.01, momentum=0.9)
    loss = net.train_step(x, y)                         # x (N, 3, 32, 32) float32, y (N,) ints
    opt.step()
    net.forward(x)                                      # inference: batch norm uses its running statistics

    cluster = tc.distribute(net, transport="zmq", workers=2)   # two local worker processes
    loss = net.train_step(x, y)                         # now the convolutions run in shards
    cluster.last_step["shares"]                         # who computed how many kernels
    cluster.close()                                     # the network's own layers back, workers stopped
    replicas = tc.distribute(net, workers=2, parallel="data")  # or "hybrid": each batch shared by images
    loss, logits = replicas.train_batch(net, x, y)      # every parallelism's step: net's grads filled

Each name is imported on its first use, so that ``tinyconv worker --threads N`` can set
the BLAS thread count before anything loads numpy.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_MODULES = {  # where each name of tc.* lives: the network, training, devices and distribution
    "tinyconv.model": "paper_net parse_arch PAPER_ARCHS Network",
    "tinyconv.layers": "Conv2D ReLU LocalResponseNorm BatchNorm2D MaxPool2D Linear SoftmaxCrossEntropy",
    "tinyconv.optim": "SGD",
    "tinyconv.trainer": "Trainer",
    "tinyconv.train_config": "TrainConfig",
    "tinyconv.data": "load_dataset synthetic_dataset",
    "tinyconv.gradcheck": "check_layer check_network",
    "backends": "get_backend available_backends",
    "transports": "get_transport available_transports",
    "tinyconv.distributed.pool": "distribute",
    "tinyconv.distributed.shard.cluster": "Cluster",
}
_API = {name: module for module, names in _MODULES.items() for name in names.split()}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'tinyconv' has no attribute {name!r}")
    value = getattr(import_module(_API[name]), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
