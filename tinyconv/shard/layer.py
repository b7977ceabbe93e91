"""ShardedBlock: the layer that stands in a network for a convolution and its tail, computed in shards.

:meth:`Cluster.attach <tinyconv.shard.cluster.Cluster.attach>` replaces each Conv2D of a
network, and the ReLU / LRN / max pool right after it (its *tail*, with ``fuse``), by one
ShardedBlock in the network's list of layers, and :meth:`~tinyconv.shard.cluster.Cluster.detach`
puts them back. The block owns the very same parameter arrays as its Conv2D, so the
optimiser, the checkpoints and the numbers do not change; only who computes them does.

Each forward asks the cluster for the layer's plan (``plan.py``) and runs the split it
calls for: by kernels, the paper's (``by_kernels.py``), or by input channels
(``by_channels.py``); its backward runs the same split with the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.base import Array, conv_output_size
from tinyconv.layers import Conv2D, Layer
from tinyconv.shard import by_channels, by_kernels
from tinyconv.shard.accounting import LayerStep, OpStats
from tinyconv.shard.block import tail_of, tail_output_hw
from tinyconv.shard.plan import Plan
from tinyconv.shard.rpc import Op

if TYPE_CHECKING:
    from tinyconv.shard.cluster import Cluster


@dataclass
class _Forward:
    """What a forward keeps for the backward: the plan and split it ran, and what they kept."""

    step: int
    plan: Plan
    split: Any  # the module: by_kernels or by_channels
    kept: Any
    stats: OpStats


class ShardedBlock(Layer):
    """x (N, C, H, W) -> the tail's output (N, F, OH', OW'): ``conv`` and ``tail`` on the cluster's shards.

    ``index``: the block's place among the network's sharded layers, which workers key
    their state by. ``by_channels``: whether the convolution is split by input channels
    (when a worker has any) rather than by kernels.
    """

    def __init__(self, cluster: Cluster, index: int, conv: Conv2D, tail: list[Layer], by_channels: bool) -> None:
        super().__init__(cluster.backend)
        self.cluster, self.index, self.conv, self.layers = cluster, index, conv, [conv, *tail]
        self.name = conv.name
        self.tail = tail_of(tail)
        self.by_channels = by_channels
        self.params = conv.params  # the same dict: the optimiser and the checkpoints see the conv's arrays
        self.decay = conv.decay
        self.step = 0  # the training step of the task being run, which the workers check

    def forward(self, x: Array, training: bool = False) -> Array:
        self.step = self.cluster.step
        plan = self.cluster.plan(self)
        split = by_channels if plan.channel_counts is not None and plan.workers else by_kernels
        y, kept, stats = split.forward(self, plan, x)
        self.cache = _Forward(self.step, plan, split, kept, stats)
        return y

    def backward(self, dy: Array) -> Array | None:
        fwd = self.cache
        self.step = fwd.step
        dx, dw, db, stats = fwd.split.backward(self, fwd.plan, dy, fwd.kept)
        self.grads = self.conv.grads = {"w": dw, "b": db}
        self.cluster.finished(self, LayerStep(self.name, fwd.plan.counts, fwd.plan.channel_counts, fwd.stats, stats))
        return dx

    # ---- for the splits -----------------------------------------------------------------
    @property
    def seats(self) -> list[tuple[str, int | None]]:
        return self.cluster.seats

    def op(self, what: str) -> Op:
        """A new distributed op of this layer ("forward" or "backward")."""
        return self.cluster.rpc.op(f"{what} of {self.name}", self.backend.synchronize)

    def header(self) -> dict[str, int]:
        """The fields every task of this layer carries."""
        return {"step": self.step, "layer": self.index}

    def host(self, a: Array) -> np.ndarray:
        """A backend array as a C-contiguous float32 host array (a view when already one)."""
        return np.ascontiguousarray(self.backend.to_numpy(a), dtype=np.float32)

    def conv_shape(self, x_shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """(N, F, OH, OW) of the convolution's output for an input of ``x_shape``."""
        c = self.conv
        n, _, h, w = x_shape
        return n, c.out_channels, *(conv_output_size(s, c.kernel, c.stride, c.padding) for s in (h, w))

    def output_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        n, f, oh, ow = self.conv_shape(x_shape)
        return (n, f, *tail_output_hw(oh, ow, self.tail))

    def __repr__(self) -> str:
        return f"ShardedBlock({' -> '.join(map(repr, self.layers))})"
