"""The master's own forward of one image of a worker's slice: the image check, the hybrid's kernel sample, and
the round-off counts (``roundings``) they, one image's backward and the replays are held to.

An image's row depends on the other images only through batch norm's statistics, so each slice returns them
(``stats``) and the master's image is an evaluation at those statistics (``slice_statistics``).
"""

from __future__ import annotations

import numpy as np

from backends.conformance.checks import FN, scale
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape
from tinyconv.distributed.spot_sample import Pair, pair
from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm
from tinyconv.model import Network
from transports.base import Message


def roundings(net: Network, x_shape: tuple[int, ...]) -> tuple[int, int]:
    """k of ``net``'s outputs, and of its gradients, on x (N, C, H, W): the reductions on the longest path.

    Forward: a convolution's C K K products and its bias, a linear layer's inputs, batch norm's mean and
    variance over N H W, LRN's ``size`` squares and its pow. Backward, on top: dx's F K K (or the linear
    layer's outputs), dw's N OH OW (or N), batch norm's two sums over N H W again, LRN again."""
    forward = backward = 0
    shape = x_shape
    for layer in net.layers:
        out = layer.output_shape(shape)
        if isinstance(layer, Conv2D):
            f, c, kh, kw = layer.params["w"].shape
            forward += c * kh * kw + 1
            backward += f * kh * kw + out[0] * out[2] * out[3]
        elif isinstance(layer, Linear):
            n_out, n_in = layer.params["w"].shape  # (M, D)
            forward += n_in + 1
            backward += n_out + shape[0]
        elif isinstance(layer, (BatchNorm2D, LocalResponseNorm)):  # as many roundings back as forth
            norm = 2 * shape[0] * shape[2] * shape[3] if isinstance(layer, BatchNorm2D) else layer.size + 2
            forward, backward = forward + norm + FN, backward + norm + FN
        shape = out
    return forward, forward + backward


def slice_statistics(net: Network, stats: np.ndarray | None, x_shape: tuple[int, ...]) -> int:
    """Set each batch norm's running statistics to the worker's batch mean and biased variance over its slice x
    (``x_shape``), from the ``stats`` it returned (the unbiased variance is M / (M - 1) times the biased one,
    M = n H W), so that an evaluation forward normalises as its training one did. Returns the roundings that
    adds: the scaling to the unbiased variance and back."""
    if stats is None:
        return 0
    flat.unpack(net, stats, "buffers")
    shape = x_shape
    for layer in net.layers:
        if isinstance(layer, BatchNorm2D):
            m = shape[0] * shape[2] * shape[3]
            var = layer.backend.to_numpy(layer.buffers["running_var"]).astype(np.float64) * (max(m - 1, 1) / m)
            var = np.maximum(var, 0.0)  # a wrong worker's: its image's numbers will not match
            layer.buffers["running_var"] = layer.backend.asarray(var.astype(np.float32))
        shape = layer.output_shape(shape)
    return 2


def image(task: Message, reply: Message, part: Network, extra: int, j: int) -> tuple[str, Pair]:
    """Image j of the slice run forward on the master by ``part`` (its weights and the worker's statistics loaded:
    ``extra`` the roundings that adds), against the worker's row of logits (or features)."""
    be, x = part.backend, task.arrays["x"]
    name = "logits" if task.kind == "replica_step" else "features"
    got = reply.arrays[name][j : j + 1]
    mine = np.asarray(be.to_numpy(part.forward(be.asarray(x[j : j + 1].copy()), training=False)), np.float32)
    return f"image {j}'s {name}", pair(got, mine.reshape(got.shape), roundings(part, x.shape)[0] + extra)


def kernel(task: Message, reply: Message, net: Network, extra: int, rng: np.random.Generator) -> tuple[str, Pair]:
    """The hybrid's features of one random image and one random kernel j of its last convolution, on the
    master: the layers before that convolution on the one image, then of it only the kernels j's tail reads
    ([j - E, j + E], E the LRN's half-window; batch norm at the worker's statistics, as an evaluation). j is
    drawn among the kernels whose plane the worker sent is not all zeros (the whole image checks those).
    ``net``'s conv part is loaded as ``image``'s, ``extra`` its roundings; ``rng`` draws i and j."""
    be, x = net.backend, task.arrays["x"]
    conv = conv_part(net)
    last = max(i for i, layer in enumerate(conv.layers) if isinstance(layer, Conv2D))
    layer, tail = conv.layers[last], conv.layers[last + 1 :]
    i = int(rng.integers(len(x)))
    planes = reply.arrays["features"][i].reshape(feature_shape(net, task.header["net"]["image_size"]))
    live = np.flatnonzero(np.any(planes != 0, axis=(1, 2)))  # a plane ReLU silenced shows no scaling
    j = int(rng.choice(live)) if live.size else int(rng.integers(layer.out_channels))
    e = max((t.size // 2 for t in tail if isinstance(t, LocalResponseNorm)), default=0)
    span = slice(max(0, j - e), min(layer.out_channels, j + e + 1))
    h = Network(be, conv.layers[:last]).forward(be.asarray(x[i : i + 1].copy()), training=False)
    w, b = (be.asarray(be.to_numpy(layer.params[p])[span].copy()) for p in ("w", "b"))
    out, _ = be.conv2d_forward(h, w, b, layer.stride, layer.padding)
    top = scale(be.to_numpy(out))  # ReLU can leave far less than the sums it cut: the forward's scale
    for t in tail:
        if isinstance(t, BatchNorm2D):  # its entries over the span, in a norm of their own
            part = BatchNorm2D(be, span.stop - span.start, t.momentum, t.eps)
            for table in ("params", "buffers"):
                for name, a in getattr(t, table).items():
                    getattr(part, table)[name] = be.asarray(be.to_numpy(a)[span].copy())
            t = part
        out = t.forward(out, training=False)
    mine = np.asarray(be.to_numpy(out), np.float32)[0, j - span.start]
    got = planes[j]
    return f"image {i}'s features of kernel {j}", pair(got, mine, roundings(conv, x.shape)[0] + extra, top)
