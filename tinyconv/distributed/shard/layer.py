"""ShardedBlock: the layer that stands in a network for a convolution and its tail, computed in shards.

It owns the very same parameter arrays as its Conv2D, so the optimiser, the checkpoints and the
numbers do not change; only who computes them does. Each forward runs the split its plan calls for
(``by_kernels.py`` or ``by_channels.py``), the backward the same one; a worker lost during either:
the layer runs again on a new plan, a backward whose forward had the lost worker its forward first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from backends.base import Array, Backend
from tinyconv.distributed.accounting import LayerStep, OpStats
from tinyconv.distributed.rpc import Lost, Op, Rpc
from tinyconv.distributed.shard import by_channels, by_kernels
from tinyconv.distributed.shard.block import tail_output_hw
from tinyconv.distributed.shard.norm import SplitNorm, norm_of
from tinyconv.distributed.shard.plan import Plan
from tinyconv.distributed.wire_codec import Narrowing
from tinyconv.layers import BatchNorm2D, Conv2D, Layer, LocalResponseNorm, MaxPool2D, ReLU


def tail_of(layers: list[Any], training: bool = False) -> list[dict[str, Any]]:
    """Specs for the leading run of ReLU / LocalResponseNorm / MaxPool2D / one BatchNorm2D in ``layers``;
    ``training``: batch norm's, normalising by the batch's statistics rather than the running ones."""
    tail: list[dict[str, Any]] = []
    for layer in layers:
        if isinstance(layer, BatchNorm2D) and not any(spec["op"] == "bn" for spec in tail):
            tail.append({"op": "bn", "eps": float(layer.eps), "training": training})
        elif isinstance(layer, ReLU):
            tail.append({"op": "relu"})
        elif isinstance(layer, LocalResponseNorm):
            floats = {k: float(getattr(layer, k)) for k in ("alpha", "beta", "k")}
            tail.append({"op": "lrn", "size": layer.size, **floats})
        elif isinstance(layer, MaxPool2D):
            tail.append({"op": "maxpool", "kernel": layer.kernel, "stride": layer.stride, "padding": layer.padding})
        else:
            break
    return tail


class Coordinator(Protocol):
    """What a sharded layer needs of the cluster that attached it (``cluster.py``)."""

    backend: Backend  # the master's
    rpc: Rpc
    placement: list[tuple[str, int | None]]  # the participants, in order: (name, worker index or None)
    lost: dict[int, str]  # the workers lost, index -> why
    gave: set[int]  # the workers whose answers this step has taken
    step: int  # training steps finished
    pipeline: int  # images per chunk of a layer split by input channels (0: the whole batch)

    def plan(self, block: ShardedBlock) -> Plan: ...

    def expect(
        self, block: ShardedBlock, batch: int, what: str
    ) -> tuple[dict[int, float], dict[int | None, int] | None]: ...

    def lose(self, workers: dict[int, str], refuse: bool = False) -> None: ...

    def finished(self, block: ShardedBlock, done: LayerStep) -> None: ...

    def codec(self, block: ShardedBlock) -> Narrowing | None: ...


@dataclass
class _Forward:
    """What a forward keeps for the backward: the plan and split it ran, and what they kept."""

    step: int
    x: Array  # its input, to run it again if a worker of its plan is lost before the backward
    training: bool
    statistics: dict[str, Array]  # the tail's batch norm's running statistics before it, which it ran again starts from
    plan: Plan
    split: Any  # the module: by_kernels or by_channels
    kept: Any
    stats: OpStats


class ShardedBlock(Layer):
    """x (N, C, H, W) -> the tail's output (N, F, OH', OW'): ``conv`` and ``tail`` on the cluster's shards.

    ``index``: the block's place among the network's sharded layers, by which the workers keep
    its state. ``by_channels``: the convolution goes by input channels (when a worker has any)
    rather than by kernels.
    """

    def __init__(self, cluster: Coordinator, index: int, conv: Conv2D, tail: list[Layer], by_channels: bool) -> None:
        super().__init__(cluster.backend)
        self.cluster, self.index, self.conv, self.layers = cluster, index, conv, [conv, *tail]
        self.name = conv.name
        self.tail, self.norm = tail_of(tail), norm_of(tail)
        self.by_channels = by_channels
        self.params = conv.params  # the same dict: the optimiser and the checkpoints see the conv's arrays
        self.decay = conv.decay

    def forward(self, x: Array, training: bool = False) -> Array:
        y, self.cache = self._forward(x, self.cluster.step, training)
        return y

    def _forward(self, x: Array, step: int, training: bool) -> tuple[Array, _Forward]:
        """The forward on the current plan -- again on the next one while workers are lost."""
        tail = tail_of(self.layers[1:], training)
        statistics = dict(self.norm.buffers) if self.norm is not None else {}
        while True:
            plan = self.cluster.plan(self)
            split = by_channels if plan.channel_counts is not None and plan.workers else by_kernels
            pipeline = (self.cluster.pipeline,) if split is by_channels else ()  # images per chunk
            op = self._op("forward", step, x.shape[0])
            try:
                y, kept = split.forward(op, self.conv, tail, plan, x, SplitNorm(self.norm, training), *pipeline)
            except Lost as e:
                self.cluster.lose(e.workers, e.wrong)
                self._rewind(statistics)
                continue
            self.cluster.gave.update(op.compute)
            stats = OpStats.from_op(op, self.cluster.placement)
            return y, _Forward(step, x, training, statistics, plan, split, kept, stats)

    def backward(self, dy: Array) -> Array | None:
        fwd = self.cache
        while True:
            if any(p.worker in self.cluster.lost for p in fwd.plan.workers):  # its kept state went with it
                self._rewind(fwd.statistics)
                _, fwd = self._forward(fwd.x, fwd.step, fwd.training)
            op = self._op("backward", fwd.step, fwd.x.shape[0])
            try:
                dx, dw, db, dnorm = fwd.split.backward(op, self.conv, fwd.plan, dy, fwd.kept)
                self.cluster.gave.update(op.compute)
                break
            except Lost as e:
                self.cluster.lose(e.workers, e.wrong)
        self.cache = None
        self.grads = self.conv.grads = {"w": dw, "b": db}
        if self.norm is not None:
            self.norm.grads = dnorm
        stats = OpStats.from_op(op, self.cluster.placement)
        done = LayerStep(self.name, fwd.plan.counts, fwd.plan.channel_counts, fwd.stats, stats, fwd.x.shape[0])
        self.cluster.finished(self, done)
        return dx

    def _rewind(self, statistics: dict[str, Array]) -> None:
        """The batch norm's running statistics as a forward found them, to run it again: it folds its batch in once."""
        if self.norm is not None:
            self.norm.buffers = dict(statistics)

    def _op(self, what: str, step: int, batch: int) -> Op:
        """A distributed op of this layer on ``batch`` images; its tasks carry the step and the layer's index,
        go on the wire by the cluster's codec for the layer (None: as they are), and have the compute
        deadlines of what the cluster expects of each worker."""
        fields = {"step": step, "layer": self.index}
        expect, units = self.cluster.expect(self, batch, what)
        op = f"{what} of {self.name}"
        return self.cluster.rpc.op(op, self.backend, fields, codec=self.cluster.codec(self), expect=expect, units=units)

    def leaves(self) -> list[Layer]:
        return self.layers

    def output_shape(self, x_shape: tuple[int, ...]) -> tuple[int, ...]:
        n, f, oh, ow = self.conv.output_shape(x_shape)
        return (n, f, *tail_output_hw(oh, ow, self.tail))

    def __repr__(self) -> str:
        return f"ShardedBlock({' -> '.join(map(repr, self.layers))})"
