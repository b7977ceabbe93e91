"""A network's parameters, gradients and batch-norm statistics as one flat float32 vector each.

A replica's state crosses the wire as one array instead of one per parameter: the order is
the network's own (``Network.named_params``, then each layer's buffers in list order), the
same on every participant because every replica is built from the same description. For
the paper's ``50:500`` network P = 949,010 parameters, 3.8 MB::

    vector = concat(conv1.w.ravel(), conv1.b, conv2.w.ravel(), conv2.b, fc1.w.ravel(), fc1.b)

Packing copies (P floats, a millisecond), and so does unpacking: a vector received may be
read-only (a wire frame) or shared (the in-process transport hands every worker the master's
own array), and batch norm updates its running statistics in place.
"""

from __future__ import annotations

import math

import numpy as np

from tinyconv.model import Network


def _tables(net: Network, table: str) -> list[tuple[dict, str]]:
    """(the layer's dict, the entry's name) for every parameter ("params", "grads") or buffer, in order."""
    if table == "buffers":
        return [(layer.buffers, name) for layer in net.layers for name in layer.buffers]
    return [(getattr(layer, table), name) for _, layer, name in net.named_params()]


def _shapes(net: Network, table: str) -> list[tuple[int, ...]]:
    """Each entry's shape in vector order: a buffer's, or its parameter's (a gradient has the same)."""
    return [tuple(entries[name].shape) for entries, name in _tables(net, "params" if table == "grads" else table)]


def sizes(net: Network, table: str = "params") -> list[int]:
    """The number of floats of each parameter (or buffer, ``table="buffers"``), in vector order."""
    return [math.prod(shape) for shape in _shapes(net, table)]


def spans(net: Network) -> dict[str, slice]:
    """Where each parameter ('conv1.w', ...) sits in the vector (and its gradient in a gradient vector)."""
    ends = np.cumsum(sizes(net))
    return {p: slice(end - n, end) for (p, _, _), n, end in zip(net.named_params(), sizes(net), ends, strict=True)}


def pack(net: Network, table: str = "params") -> np.ndarray:
    """``table`` ("params", "grads" or "buffers") of every layer as one host float32 vector."""
    be = net.backend
    parts = [np.ravel(be.to_numpy(entries[name])) for entries, name in _tables(net, table)]
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)


def unpack(net: Network, vector: np.ndarray, table: str = "params") -> None:
    """Set ``table`` of every layer from ``vector`` (as ``pack`` made it), on the network's backend."""
    be, start = net.backend, 0
    shapes = _shapes(net, table)
    total = sum(math.prod(s) for s in shapes)
    if vector.shape != (total,):
        raise ValueError(f"a {table} vector of this network has shape ({total},), got {tuple(vector.shape)}")
    for (entries, name), shape in zip(_tables(net, table), shapes, strict=True):
        n = math.prod(shape)
        entries[name] = be.asarray(np.array(vector[start : start + n].reshape(shape), dtype=np.float32))
        start += n
