"""One participant's replica: built from a short description, its slice's gradients, its timing.

The master and every worker run the same code here on their own slice of the batch, so the
numbers of a data-parallel step do not depend on who computed which images.

The gradient a slice returns is its part of the gradient of the *whole batch's* mean loss.
The loss is L = (1/N) sum_n l_n over the N images of the batch; slice i holds n_i of them,
so dL/dlogits of its rows is (softmax - onehot) / N. The backend's loss gives the slice's own
mean, (softmax - onehot) / n_i, so it is scaled by n_i / N before the backward; by the chain
rule every parameter's gradient is then the slice's share of dL/dw, and the master sums the
shares (in participant order, so the sum is deterministic)::

    dL/dw = sum_i  sum_{n in slice i} (1/N) dl_n/dw

With label smoothing eps the target onehot becomes q = (1 - eps) onehot + eps / K, and every
line above holds with q in its place: the loss is still a mean over the images.

Batch norm's running statistics are the master's to update: a slice's training forward leaves its own batch
mean and unbiased variance in its norms' running ones (:func:`keeping_statistics`), the ``stats`` it returns, and
the master folds them in, weighted by images (``Slices.sum_into``)::

    r <- (1 - m) r + m sum_i (n_i / N) stat_i
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from backends.base import Backend
from tinyconv.distributed.calibrate import median_seconds
from tinyconv.layers import BatchNorm2D, Conv2D
from tinyconv.memory import step_memory_bytes
from tinyconv.model import NORMS, Network, paper_net, parse_arch

SPEC_KEYS = {"arch": str, "norm": str, "pool_kernel": int, "num_classes": int, "in_channels": int, "image_size": int}


def spec_of(net: Network, image_size: int = 32) -> dict[str, Any]:
    """The description of ``net`` a worker builds its replica from (the paper's network only)."""
    c = net.config
    if "arch" not in c:
        raise ValueError("data parallelism replicates the paper's network (tc.paper_net); this one has no arch")
    first = next(layer for layer in net.layers if isinstance(layer, Conv2D))
    return {"arch": c["arch"], "norm": c["norm"], "pool_kernel": c["pool_kernel"],
            "num_classes": c["num_classes"], "in_channels": first.in_channels, "image_size": image_size}  # fmt: skip


def build(spec: dict[str, Any], backend: Backend, batch: int, max_bytes: int | None = None) -> Network:
    """A replica of the network ``spec`` describes (weights from seed 0: the master's come with
    each step). ValueError for a description that is not one, or that would need more than
    ``max_bytes`` for a training step of ``batch`` images."""
    if set(spec) != set(SPEC_KEYS) or not all(
        isinstance(spec[k], t) and not isinstance(spec[k], bool) for k, t in SPEC_KEYS.items()
    ):
        raise ValueError(
            f"a replica's net must have exactly {', '.join(SPEC_KEYS)} (str arch and norm, ints), got {spec!r:.200}"
        )
    c1, c2 = parse_arch(spec["arch"])
    if spec["norm"] not in NORMS:
        raise ValueError(f"norm {spec['norm']!r} is none of {', '.join(NORMS)}")
    if not (1 <= spec["num_classes"] <= 100_000 and 1 <= spec["in_channels"] <= 64 and 4 <= spec["image_size"] <= 1024):
        raise ValueError(f"num_classes, in_channels or image_size out of range in {spec!r}")
    if max_bytes is not None:
        need = step_memory_bytes(c1, c2, batch, spec["norm"], spec["pool_kernel"], image_size=spec["image_size"],
                                 num_classes=spec["num_classes"])  # fmt: skip
        if need > max_bytes:
            raise ValueError(f"a {c1}:{c2} replica at batch {batch} needs about {need:,} bytes, above this "
                             f"worker's limit of {max_bytes:,}")  # fmt: skip
    return paper_net((c1, c2), backend, spec["norm"], 0, spec["num_classes"], spec["in_channels"],
                     spec["image_size"], spec["pool_kernel"])  # fmt: skip


@contextmanager
def keeping_statistics(net: Network) -> Iterator[None]:
    """Every batch norm of ``net`` at momentum 1 inside: its update r <- (1 - m) r + m stat then leaves its batch's
    statistics (mean, unbiased variance) in place of the running ones."""
    norms = [layer for layer in net.layers if isinstance(layer, BatchNorm2D)]
    kept = [layer.momentum for layer in norms]
    for layer in norms:
        layer.momentum = 1.0
    try:
        yield
    finally:
        for layer, momentum in zip(norms, kept, strict=True):
            layer.momentum = momentum


def slice_gradients(
    net: Network,
    x: np.ndarray,
    y: np.ndarray,
    batch: int,
    smoothing: float = 0.0,
    seen: tuple[dict, dict] | None = None,
) -> np.ndarray:
    """Forward (training mode), loss and backward of ``net`` on a slice of a batch of ``batch`` images.

    x (n, C, H, W) float32 host or backend array, y (n,) int labels. Fills every layer's grads
    with the slice's part of the gradient of the whole batch's mean loss (the module's docstring;
    label-smoothed by ``smoothing``) and returns the slice's logits (n, classes) on the host. Batch
    norm normalises by the slice's own statistics and leaves them in its running ones (the module's docstring).
    ``seen``: two dicts for each convolution's input and output gradient (``Network.forward``'s)."""
    be = net.backend
    n = len(y)
    if not 1 <= n <= batch:
        raise ValueError(f"a slice of {n} images of a batch of {batch}: need 1 <= slice <= batch")
    with keeping_statistics(net):
        logits = net.forward(be.asarray(x), training=True, seen=seen[0] if seen else None)
    _, dlogits = net.training_loss(smoothing)(logits, np.asarray(y))  # (softmax - onehot) / n, or (softmax - q) / n
    scaled = be.to_numpy(dlogits) * np.float32(n / batch)  # -> (softmax - onehot) / N
    net.backward(be.asarray(scaled.astype(np.float32, copy=False)), seen=seen[1] if seen else None)
    return np.array(be.to_numpy(logits), dtype=np.float32)


def time_replica(net: Network, spec: dict[str, Any], batch: int, repeats: int) -> float:
    """Seconds of one forward + backward of ``net`` (built from ``spec``) on ``batch`` random images."""
    rng = np.random.default_rng(0)
    size = spec["image_size"]
    x = rng.standard_normal((batch, spec["in_channels"], size, size)).astype(np.float32)
    y = rng.integers(0, spec["num_classes"], batch)
    return median_seconds(lambda: slice_gradients(net, x, y, batch), net.backend, repeats)
