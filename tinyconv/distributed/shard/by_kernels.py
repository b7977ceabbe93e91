"""The paper's split: a convolution by kernels. Read this first, next to docs/how-it-works.md.

A convolution with F kernels is F independent filters: kernel f reads all of the input x
and writes output channel f. Cutting the kernels into contiguous slices k_i, one per
participant (``plan.py``), changes *who* computes a feature map, never *what* it is::

    forward   y[:, k_i]          = conv(x, w[k_i], b[k_i])                 every participant gets all of x
    backward  dw[k_i], db[k_i]   = from dy[:, k_i] and x                    concatenate the rows
              dx                 = sum_i conv_backward_x(dy[:, k_i], w[k_i])   dx = W^T dY: a sum over kernels

So the master sends every worker the same x and its slice of w and b, computes its own
slice meanwhile (if it takes part), and concatenates the slices along the channel axis;
backward, it sends each worker its slice of dy, concatenates dw and db and sums the
partial dx (none for the first layer). The optimiser then updates every weight on the
master, so a new split is simply a different slicing at the next step.

With a tail after the convolution (ReLU, LRN, batch norm, max pool: ``block.py``), each
participant computes the *block* -- conv and tail -- of its kernels and their halo h_i, and
gives back the tail's output of its own kernels k_i: the same formulas with "block" for "conv",
and dy over h_i. A batch norm's gamma and beta go as b does, and come back with its batch
statistics and as dgamma and dbeta (``norm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array
from tinyconv.distributed.rpc import Op
from tinyconv.distributed.shard.block import BlockCache, block_backward, block_forward, tail_output_hw
from tinyconv.distributed.shard.norm import SplitNorm, joined_grads
from tinyconv.distributed.shard.plan import Participant, Plan
from tinyconv.layers import Conv2D
from transports.base import Message


@dataclass
class KernelSplitState:
    """What the master's forward of a layer split by kernels keeps for its backward."""

    master: BlockCache | None  # the master's own block, when it computed one
    x_shape: tuple[int, ...]
    norm: tuple[str, ...]  # a batch norm's parameters whose gradients come back (SplitNorm.grads)


def forward(
    op: Op, conv: Conv2D, tail: list[dict[str, Any]], plan: Plan, x: Array, norm: SplitNorm
) -> tuple[Array, KernelSplitState]:
    """x (N, C, H, W) -> y (N, F, OH, OW), the block of kernels k_i computed by participant i."""
    be, w, b = op.backend, conv.params["w"], conv.params["b"]
    x_host = op.host(x) if plan.workers else None  # one host copy, sent to every worker
    tasks = {}
    for p in plan.workers:
        header = {"stride": conv.stride, "padding": conv.padding, "tail": tail, "own": list(p.own)}
        w_i, b_i = be.take_kernels(w, p.halo.start, p.halo.stop), be.take_kernels(b, p.halo.start, p.halo.stop)
        arrays = {"x": x_host, "w": op.host(w_i), "b": op.host(b_i), **norm.inputs(p.halo)}
        tasks[p.worker] = op.send(p.worker, Message("block_forward", header, arrays))

    y_m = cache = None  # the master's own kernels, computed while the workers compute theirs
    mine: dict[str, Array] = {}
    if (m := plan.master) is not None:
        with op.local():
            w_m, b_m = be.take_kernels(w, m.halo.start, m.halo.stop), be.take_kernels(b, m.halo.start, m.halo.stop)
            mine = norm.local(be, m.halo)
            y_m, cache = block_forward(be, x, w_m, b_m, conv.stride, conv.padding, tail, m.own, mine)
    results = op.gather(tasks.values())
    norm.fold(op, plan.active, results, mine)

    kept = KernelSplitState(cache, tuple(x.shape), norm.grads)
    if not tasks:  # the master computed every kernel: y stays on its device
        return y_m, kept
    n, _, oh, ow = conv.output_shape(tuple(x.shape))
    oh, ow = tail_output_hw(oh, ow, tail)
    parts = [  # in order: the concatenation is y
        be.to_numpy(y_m) if p.worker is None else op.array(p.worker, results[p.worker], "y", (n, p.n_kernels, oh, ow))
        for p in plan.active
    ]
    return be.asarray(np.concatenate(parts, axis=1)), kept


# what a split's backward gives: dx or None, dw, db, and a tail's batch norm's {"gamma": dgamma, "beta": dbeta} or {}
Grads = tuple[Array | None, Array, Array, dict[str, Array]]


def backward(op: Op, conv: Conv2D, plan: Plan, dy: Array, kept: KernelSplitState) -> Grads:
    """dy (N, F, OH, OW) -> (dx (N, C, H, W) or None, dw (F, C, K, K), db (F,), dgamma and dbeta (F,)),
    by the forward's plan."""
    be = op.backend
    dy_host = be.to_numpy(dy) if plan.workers else None
    tasks = {}
    for p in plan.workers:
        arrays = {"dy": np.ascontiguousarray(dy_host[:, p.halo], dtype=np.float32)}
        tasks[p.worker] = op.send(p.worker, Message("block_backward", {"need_dx": conv.need_dx}, arrays))

    mine = None
    if (m := plan.master) is not None:
        dy_m = be.asarray(dy_host[:, m.halo]) if tasks else dy  # alone, its halo is every kernel
        with op.local():
            mine = block_backward(be, dy_m, kept.master, conv.need_dx)
    results = op.gather(tasks.values())
    if not tasks:
        return (*mine, kept.master.dnorm)

    def part(p: Participant, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """``name`` (dx, dw or db) of participant p's kernels."""
        if p.worker is None:
            return be.to_numpy(mine[("dx", "dw", "db").index(name)])
        return op.array(p.worker, results[p.worker], name, shape)

    dx = None
    if conv.need_dx:  # every participant's partial dX, summed
        dx = be.asarray(sum(part(p, "dx", kept.x_shape) for p in plan.active))
    w_shape = (conv.in_channels, conv.kernel, conv.kernel)
    dw = np.concatenate([part(p, "dw", (p.n_kernels, *w_shape)) for p in plan.active], axis=0)
    db = np.concatenate([part(p, "db", (p.n_kernels,)) for p in plan.active], axis=0)
    dnorm = joined_grads(op, plan.active, kept.norm, kept.master.dnorm if kept.master else {}, results)
    return dx, be.asarray(dw), be.asarray(db), dnorm
