"""The free checks, of the splits by images first: an answer of a worker against another of its answers, or against
what the master holds, recomputing none of the network (docs/how-it-works.md, "Spot checks").

    last_bias   data parallelism: the classifier's bias gradient follows from the logits the worker sent
    last_norm   the hybrid: its last batch norm's dbeta and dgamma follow from its features and dL/dfeatures
    last_signs  the hybrid whose features come from ReLU through LRN and max pool alone (no last norm): none < 0

and the model split's floor, by kernels or by input channels: its outputs' signs, its batch variances (``floor``).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from backends.conformance.checks import FN, float32_tolerance
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape
from tinyconv.distributed.spot_sample import Pair
from tinyconv.layers import BatchNorm2D, Conv2D, LocalResponseNorm, MaxPool2D, ReLU
from tinyconv.model import Network
from transports.base import Message


def targets(logits: np.ndarray, y: np.ndarray, smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """softmax(logits) p and the targets q, (1 - smoothing) onehot(y) + smoothing / K, of logits (n, K), float64."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    q = np.full_like(p, smoothing / z.shape[1])
    q[np.arange(len(z)), y] += 1.0 - smoothing
    return p, q


def last_bias(task: Message, reply: Message, net: Network) -> tuple[str, Pair]:
    """The gradient of the classifier's bias, db = sum over the slice of dL/dlogits = (softmax(logits) - q) / N
    (``replica.py``), from the logits the worker sent: exact but for round-off, whatever the layers below did.
    Its tolerance is the rigorous form on the terms' sizes (p + q) / N, softmax's round-off being on p, not on
    p - q; k: the softmax (K terms, an exp and a division), the smoothing and the scaling, the sum over n."""
    n, classes = reply.arrays["logits"].shape
    p, q = targets(reply.arrays["logits"], task.arrays["y"], float(task.header.get("smoothing", 0.0)))
    batch = task.header["batch"]
    tol = float32_tolerance(n + classes + 2 * FN + 6, ((p + q) / batch).sum(axis=0))
    return f"the gradient of {net.layers[-1].name}.b against its logits", (
        reply.arrays["grads"][-classes:],
        ((p - q) / batch).sum(axis=0),
        tol,
    )


@functools.lru_cache(maxsize=2)
def _norm_layout(net: Network, image: tuple[int, int, int]) -> tuple | None:
    """What ``last_norm`` reads of a replica for images of shape ``image`` (C, H, W), once (a replica's layers do
    not change): its conv part's last norm and pool, the features' shape (C, H', W') of one image, the norm's
    outputs per channel of one image, where gamma and beta start in the conv part's vector, and its length;
    None unless a max pool alone follows a batch norm."""
    conv = conv_part(net)
    norm, pool = conv.layers[-2:]
    if not (isinstance(norm, BatchNorm2D) and isinstance(pool, MaxPool2D)):
        return None
    normed = (1, *image)
    for layer in conv.layers[:-1]:
        normed = layer.output_shape(normed)
    at = {p: flat.spans(conv)[f"{norm.name}.{p}"].start for p in ("gamma", "beta")}
    return norm, pool, feature_shape(net, image[1]), math.prod(normed) // normed[1], at, sum(flat.sizes(conv))


def last_norm(
    first: Message, answer: Message, task: Message, reply: Message, net: Network, rng: np.random.Generator
) -> list[tuple[str, Pair]]:
    """The hybrid's last batch norm's dbeta and dgamma, when a max pool is all that follows it. The pool hands
    each window's gradient to the one value it took, gamma xhat + beta, so from the master's own dfeatures d
    and the features f the worker sent (both (n, C, H', W')): dbeta[c] = sum d[:, c] and dgamma[c] = sum d[:, c]
    (f[:, c] - beta[c]) / gamma[c]. The rigorous form on the terms' sizes, k: the sum over the norm's n H W
    outputs, the pool's windows that took the same value (K K at most), the few roundings of f, and the
    master's own sums over the n H' W' features. An eighth of the channels (at least 8), a run of them from a
    random start (views, not copies): a whole gradient changed shows in any of them. Without that norm: the
    features' signs (``last_signs``)."""
    layout = _norm_layout(net, first.arrays["x"].shape[1:])
    grads, features = reply.arrays.get("grads"), answer.arrays.get("features")
    if layout is None or grads is None or features is None:
        return last_signs(answer, net) if layout is None else []
    norm, pool, (c, h, w), per_channel, at, total = layout
    n = len(first.arrays["x"])
    if grads.shape != (total,) or features.size != n * c * h * w:
        return []  # not this file's to judge: the split's shape check loses the worker
    m = min(c, max(8, c // 8))
    s = int(rng.integers(c - m + 1))  # the run's start
    d, f = (a.reshape(n, c, h * w)[:, s : s + m] for a in (task.arrays["dfeatures"], features))
    k = n * per_channel + pool.kernel**2 + 8 + n * h * w  # the worker's sums, the pool's, f's; the master's own
    at = {p: slice(start + s, start + s + m) for p, start in at.items()}
    gamma, beta = (first.arrays["params"][at[p]].astype(np.float64) for p in ("gamma", "beta"))
    # per channel: sum d, sum |d| (float64); sum d f, sum |d| |f| (float32: k); dgamma = (sum d f - beta sum d) / g
    ad = np.abs(d)
    dsum, dabs = (a.sum(axis=(0, 2), dtype=np.float64) for a in (d, ad))
    df, dfabs = (np.einsum("nck,nck->c", a, b).astype(np.float64) for a, b in ((d, f), (ad, np.abs(f))))
    live = gamma != 0  # gamma 0: no xhat to take, dgamma not checked
    g = np.where(live, gamma, 1.0)
    gamma_tol = np.where(live, float32_tolerance(k, (dfabs + np.abs(beta) * dabs) / np.abs(g)), np.inf)
    what = f"the gradient of {norm.name}.%s against its features"
    return [
        (what % "beta", (grads[at["beta"]], dsum, float32_tolerance(k, dabs))),
        (what % "gamma", (grads[at["gamma"]], (df - beta * dsum) / g, gamma_tol)),
    ]


def never_negative(ops: list[str | None]) -> bool:
    """Whether a tail of ``ops`` (as block.py's specs name them) leaves nothing below 0: a ReLU that only LRNs and
    max pools follow (LRN scales by s^-beta > 0, a max pool takes one of its inputs; in float32 as in the math)."""
    after = ops[len(ops) - ops[::-1].index("relu") :] if "relu" in ops else [None]
    return all(op in ("lrn", "maxpool") for op in after)


@functools.lru_cache(maxsize=2)
def _never_negative(net: Network) -> bool:
    """Whether the replica's conv part ends in a plain ReLU, then only plain LRNs and max pools (``last_signs``)."""
    layers = conv_part(net).layers
    tail = layers[max(i for i, layer in enumerate(layers) if isinstance(layer, Conv2D)) + 1 :]
    return never_negative([_OPS.get(type(layer)) for layer in tail])


_OPS = {ReLU: "relu", LocalResponseNorm: "lrn", MaxPool2D: "maxpool"}  # the plain layers, by their specs' names


def last_signs(answer: Message, net: Network) -> list[tuple[str, Pair]]:
    """The hybrid's features where ``_never_negative``: none below 0 (:func:`floor`). Nothing else: 1 % off keeps
    every sign."""
    features = answer.arrays.get("features")
    if not _never_negative(net) or features is None or not features.size:
        return []
    return [("its smallest feature, which ReLU, LRN and max pool leave at 0 or above", _at_least_0(features))]


def floor(y: np.ndarray, stats: dict[str, np.ndarray], tail: list[dict]) -> list[tuple[str, float]]:
    """The model split's floor, what may not be below 0 and its smallest value (or 0): a block's output y and a
    training batch norm's batch variances (``stats``' var) as its ``tail`` (block.py's specs) made them, y where
    :func:`never_negative`, every variance (the backends sum centred squares). So one is wrong whatever its size:
    a result x -50 is caught at its first step on any tail."""
    out = []
    if never_negative([spec["op"] for spec in tail]):
        out.append(("its smallest output, which ReLU, LRN and max pool leave at 0 or above", float(y.min(initial=0))))
    if "var" in stats:
        out.append(("its smallest batch variance, a mean of squares", float(stats["var"].min(initial=0))))
    return out


def _at_least_0(a: np.ndarray) -> Pair:
    """a's smallest entry, or 0 where none is negative, against 0 exactly."""
    return np.min(a, initial=0.0).reshape(1), np.zeros(1), 0.0
