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
from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm, MaxPool2D
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


def field(layers: list, shape: tuple[int, ...], at: tuple[int, int]) -> list[tuple[tuple[int, int], ...]]:
    """The rows and columns [lo, hi] of each layer's input that the output at ``at`` (row, column) of the last one
    reads, from x of ``shape`` (N, C, H, W): its receptive field, walked back. A convolution or pool reads its
    padding too (lo below 0, hi past the map); the layer before it makes only the part on its map."""
    shapes = [shape]
    for layer in layers[:-1]:
        shapes.append(layer.output_shape(shapes[-1]))
    out, reads = [(a, a) for a in at], []
    for layer, size in zip(reversed(layers), reversed(shapes), strict=True):
        k, s, p = (layer.kernel, layer.stride, layer.padding) if isinstance(layer, (Conv2D, MaxPool2D)) else (1, 1, 0)
        need = tuple((lo * s - p, hi * s - p + k - 1) for lo, hi in out)
        reads.append(need)
        out = [(max(lo, 0), min(hi, n - 1)) for (lo, hi), n in zip(need, size[2:], strict=True)]
    return reads[::-1]


def kernel(task: Message, reply: Message, net: Network, extra: int, rng: np.random.Generator) -> tuple[str, Pair]:
    """The hybrid's feature of one random image, kernel j and position on the master (``feature``), against the
    worker's. j is drawn among the kernels whose plane the worker sent is not constant (the whole image checks
    those), the position among that plane's entries at least half as far from its median as the farthest (where
    1 % shows above round-off, whatever the sign). ``net``'s conv part is loaded as ``image``'s, ``extra`` its
    roundings; ``rng`` draws."""
    x, conv = task.arrays["x"], conv_part(net)
    i = int(rng.integers(len(x)))
    planes = reply.arrays["features"][i].reshape(feature_shape(net, task.header["net"]["image_size"]))
    live = np.flatnonzero(np.ptp(planes, axis=(1, 2)) > 0)  # a plane ReLU silenced (batch norm: beta) shows nothing
    j = int(rng.choice(live)) if live.size else int(rng.integers(planes.shape[0]))
    big = np.abs(planes[j] - np.median(planes[j]))
    r, c = divmod(int(rng.choice(np.flatnonzero(big >= big.max() / 2))), planes.shape[2])
    mine, top = feature(conv, x[i : i + 1], j, r, c)
    k = roundings(conv, x.shape)[0] + extra
    return f"image {i}'s feature of kernel {j} at ({r}, {c})", pair(planes[j, r, c].reshape(1), mine, k, top)


def feature(conv: Network, x: np.ndarray, j: int, r: int, c: int) -> tuple[np.ndarray, float]:
    """The output of the conv part ``conv`` on one image x (1, C, H, W) at kernel j, row r and column c (1,), and
    its scale: of every layer only its receptive field (``field``), and of the last convolution only the kernels
    j's tail reads ([j - E, j + E], E the LRN's half-window; batch norm as an evaluation). The scale: that
    convolution's terms there, max |W| * |input| + |b|, times the tail's batch norm's largest gain (ReLU can leave
    far less than the sums it cut)."""
    be = conv.backend
    last = max(i for i, layer in enumerate(conv.layers) if isinstance(layer, Conv2D))
    e = max((t.size // 2 for t in conv.layers[last + 1 :] if isinstance(t, LocalResponseNorm)), default=0)
    span = slice(max(0, j - e), min(conv.layers[last].out_channels, j + e + 1))
    reads, shape = field(conv.layers, x.shape, (r, c)), x.shape
    (rows, cols), top = reads[0], 0.0
    h = be.asarray(x[:, :, max(rows[0], 0) : rows[1] + 1, max(cols[0], 0) : cols[1] + 1].copy())
    for at, layer in enumerate(conv.layers):
        if isinstance(layer, (Conv2D, MaxPool2D)):  # its padding made here, the op then runs without any
            (first_row, last_row), (first_col, last_col) = reads[at]
            fill = 0.0 if isinstance(layer, Conv2D) else -np.inf  # a pool's padding is never selected
            held = be.to_numpy(h)
            padded = np.full((*held.shape[:2], last_row - first_row + 1, last_col - first_col + 1), fill, np.float32)
            padded[:, :, max(-first_row, 0) :, max(-first_col, 0) :][:, :, : held.shape[2], : held.shape[3]] = held
            h = be.asarray(padded)
        if isinstance(layer, MaxPool2D):
            h, _ = be.maxpool_forward(h, layer.kernel, layer.stride, 0)
        elif isinstance(layer, Conv2D):
            w, b = (be.to_numpy(layer.params[p])[span if at == last else slice(None)] for p in ("w", "b"))
            if at == last:  # its terms: the scale the tail's output is held to
                size = be.conv2d_forward(*(be.asarray(np.abs(a)) for a in (be.to_numpy(h), w, b)), layer.stride, 0)
                top = scale(be.to_numpy(size[0]))
            h, _ = be.conv2d_forward(h, be.asarray(w.copy()), be.asarray(b.copy()), layer.stride, 0)
        elif isinstance(layer, BatchNorm2D) and at > last:  # its entries over the span, in a norm of their own
            part = BatchNorm2D(be, span.stop - span.start, layer.momentum, layer.eps)
            for table in ("params", "buffers"):
                for name, a in getattr(layer, table).items():
                    getattr(part, table)[name] = be.asarray(be.to_numpy(a)[span].copy())
            h = part.forward(h, training=False)
            gain = be.to_numpy(part.params["gamma"]) / np.sqrt(be.to_numpy(part.buffers["running_var"]) + part.eps)
            top *= float(np.abs(gain).max())
        else:
            h = layer.forward(h, training=False)
        shape = layer.output_shape(shape)
    return np.asarray(be.to_numpy(h), np.float32)[0, j - span.start].reshape(1), top
