"""The convolutions of a network at a batch size: what a task moves, so what a message may hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinyconv.distributed.shard.layer import tail_of
from tinyconv.layers import Conv2D, Linear
from tinyconv.model import Network


@dataclass(frozen=True)
class ConvShape:
    """One convolution of a network at a batch size: x (N, C, H, W), w (F, C, K, K), y (N, F, OH, OW)."""

    name: str
    x: tuple[int, int, int, int]
    w: tuple[int, int, int, int]
    y: tuple[int, int, int, int]
    need_dx: bool
    tail: tuple[dict[str, Any], ...] = ()  # the ReLU / LRN / batch norm / max pool after it, in training (block.py)


def conv_shapes(net: Network, batch: int, image_size: int = 32) -> list[ConvShape]:
    """The convolutions of ``net`` in order, with their shapes at ``batch`` images of ``image_size``."""
    shape: tuple[int, ...] = (batch, 3, image_size, image_size)
    convs = []
    for i, layer in enumerate(net.layers):
        if isinstance(layer, Linear):
            break
        if isinstance(layer, Conv2D):
            x = (batch, layer.in_channels, *shape[2:])
            w, y = tuple(layer.params["w"].shape), layer.output_shape(x)
            tail = tuple(tail_of(net.layers[i + 1 :], training=True))
            convs.append(ConvShape(f"conv{len(convs) + 1}", x, w, y, layer.need_dx, tail))
        shape = layer.output_shape(shape)
    return convs
