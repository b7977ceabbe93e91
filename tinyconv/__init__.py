"""tinyconv: a small, readable CNN framework whose convolutions are split across machines.

``import tinyconv as tc``; README.md's "From Python" shows the names in use. Each name is imported on
its first use, so that ``tinyconv worker --threads N`` can set the BLAS thread count before anything
loads numpy.
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
