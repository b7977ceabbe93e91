"""An optimisation beside the paper's split: the convolution split by its *input* channels.

Split by kernels (``by_kernels.py``), every participant reads all of the input: it builds
the im2col columns of the whole x (491 MB for 300:1000's conv2 at batch 64), streams all
of them through its forward and its dW GEMM, and computes a full-size partial dX. With
two participants that duplicated, memory-bound work keeps two halves from costing half
the time. But a convolution is also a sum over its input channels; with participant i
holding the channels c_i::

    forward   y_conv = sum_i P_i + b,   P_i = conv(x[:, c_i], w[:, c_i])      (N, F, OH, OW): all F kernels
    backward  dx[:, c_i], dw[:, c_i] = the conv backward of P_i from all of dY_conv;   db from dY_conv alone

so a participant builds the im2col of its channels only, and its GEMMs read only its
columns: nothing is computed twice. The tail still goes by kernels (own k_i, halo h_i,
``block.py``), so each way takes two rounds through the master::

    forward   1. partial_forward    x[:, c_i], w[:, c_i]   -> the parts of P_i the others' halos need
              2. tail_forward       b[h_i], sum_{j!=i} P_j[:, h_i]
                                                           -> y[:, k_i] = tail(P_i[:, h_i] + sum + b[h_i])
    backward  1. tail_backward      dy[:, h_i]             -> dyc_i, the conv-output gradient of k_i
              2. partial_backward   dyc_j for every j != i -> dx[:, c_i], dw[:, c_i], db

The price is bytes: each way, every worker sends and receives about its share of the conv
output, which costs nothing on one machine but more than the kernel split on a LAN (so
``Cluster``'s ``split="auto"`` uses it only with workers on the master's host). A worker's
round 2 goes out as soon as the others' round 1 is in (:meth:`~tinyconv.shard.rpc.Op.relay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array
from tinyconv.layers import Conv2D
from tinyconv.shard.block import BlockCache, owned, tail_backward, tail_forward, tail_output_hw
from tinyconv.shard.plan import Participant, Plan
from tinyconv.shard.rpc import Op
from transports.base import Message


@dataclass
class Kept:
    """What a forward keeps for its backward."""

    master: BlockCache | None  # the master's tail over its partial convolution, when it has channels
    x_shape: tuple[int, ...]


@dataclass
class Partial:
    """What the master has of one participant's partial convolution P (N, F, OH, OW): P[:, :lo_end]
    as ``lo`` and P[:, hi_start:] as ``hi`` (all of P, for the master's own: lo = P)."""

    lo: np.ndarray | None
    hi: np.ndarray | None
    hi_start: int

    def on(self, kernels: slice) -> np.ndarray:
        """P[:, kernels], for a range that lies in one of the two parts (a view)."""
        if self.lo is not None and kernels.stop <= self.lo.shape[1]:
            return self.lo[:, kernels]
        return self.hi[:, kernels.start - self.hi_start : kernels.stop - self.hi_start]


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def _summed(terms: list[np.ndarray]) -> np.ndarray:
    """The sum of ``terms`` in a new contiguous array."""
    total = np.array(terms[0])
    for term in terms[1:]:
        total += term
    return total


def _give(busy: list[Participant], i: int, total: int) -> list[int]:
    """What the others need of participant i's partial, [lo_end, hi_start]: the kernels up to the
    end of the earlier participants' halos, and from the start of the later ones'."""
    return [max((q.halo.stop for q in busy[:i]), default=0), min((q.halo.start for q in busy[i + 1 :]), default=total)]


def forward(op: Op, conv: Conv2D, tail: list[dict[str, Any]], plan: Plan, x: Array) -> tuple[Array, Kept]:
    """x (N, C, H, W) -> y (N, F, OH', OW'), the convolution split by input channels, its tail by kernels."""
    be, total, busy, m = op.backend, conv.out_channels, plan.busy, plan.master
    x_h, w_h, b_h = op.host(x), op.host(conv.params["w"]), op.host(conv.params["b"])
    n, _, oh, ow = conv.output_shape(x_h.shape)
    worker = {p.worker: p for p in plan.workers}
    give = {p.worker: _give(busy, i, total) for i, p in enumerate(busy) if p.worker is not None}
    partials: dict[str, Partial] = {}

    def others_on(p: Participant) -> list[np.ndarray]:
        return [partials[q.name].on(p.halo) for q in busy if q is not p]

    # round 1: each worker's partial convolution; the master's meanwhile
    first = {}
    for k, p in worker.items():
        header = {"stride": conv.stride, "padding": conv.padding, "tail": tail}
        header |= {"halo": [p.halo.start, p.halo.stop], "own": list(p.own), "give": give[k]}
        arrays = {"x": np.ascontiguousarray(x_h[:, p.channels]), "w": np.ascontiguousarray(w_h[:, p.channels])}
        first[k] = op.send(k, Message("partial_forward", header, arrays))
    if m is not None:
        with op.local():
            x_m, w_m = be.asarray(x_h[:, m.channels]), be.asarray(w_h[:, m.channels])
            p_m, conv_m = be.conv2d_forward(x_m, w_m, be.zeros((total,)), conv.stride, conv.padding)
            partials[m.name] = Partial(be.to_numpy(p_m), None, total)

    def arrived(k: int, reply: Message) -> None:
        lo_end, hi_start = give[k]
        lo = op.array(k, reply, "p_lo", (n, lo_end, oh, ow)) if lo_end > 0 else None
        hi = op.array(k, reply, "p_hi", (n, total - hi_start, oh, ow)) if hi_start < total else None
        partials[worker[k].name] = Partial(lo, hi, hi_start)

    def tail_task(k: int) -> Message:
        p = worker[k]
        terms = others_on(p)
        arrays = {"b": np.ascontiguousarray(b_h[p.halo])} | ({"sum": _summed(terms)} if terms else {})
        return Message("tail_forward", {}, arrays)

    # round 2: each worker the others' partials summed over its halo, as soon as the master has them
    ready = lambda k: all(q.name in partials for q in busy if q.worker != k)  # noqa: E731
    second = op.relay(first, ready, tail_task, arrived)
    y_m = cache = None
    if m is not None:
        with op.local():
            s = partials[m.name].on(m.halo) + b_h[m.halo, None, None]
            for term in others_on(m):
                s += term
            y_m, cache = tail_forward(be, be.asarray(s), conv_m, tail, m.own)
            y_m = be.to_numpy(y_m)
    results = op.gather(second.values())
    oh2, ow2 = tail_output_hw(oh, ow, tail)
    parts = [y_m if p is m else op.array(p.worker, results[p.worker], "y", (n, p.n_kernels, oh2, ow2)) for p in busy]
    return be.asarray(np.concatenate(parts, axis=1)), Kept(cache, x_h.shape)


def backward(op: Op, conv: Conv2D, plan: Plan, dy: Array, kept: Kept) -> tuple[Array | None, Array, Array]:
    """dy (N, F, OH', OW') -> (dx (N, C, H, W) or None, dw (F, C, K, K), db (F,)), by the forward's plan."""
    be, busy, m = op.backend, plan.busy, plan.master
    dy_h = be.to_numpy(dy)
    n, _, h, wd = kept.x_shape
    _, total, oh, ow = conv.output_shape(kept.x_shape)
    worker = {p.worker: p for p in plan.workers}
    dyc: dict[str, np.ndarray] = {}  # participant -> its own kernels' conv-output gradient (N, own, OH, OW)

    # round 1: each participant's tail backward
    first = {}
    for k, p in worker.items():
        arrays = {"dy": np.ascontiguousarray(dy_h[:, p.halo], dtype=np.float32)}
        first[k] = op.send(k, Message("tail_backward", {}, arrays))
    if m is not None:
        with op.local():
            d_m = tail_backward(be, be.asarray(dy_h[:, m.halo]), kept.master)
            dyc[m.name] = np.ascontiguousarray(owned(be, d_m, kept.master))

    def arrived(k: int, reply: Message) -> None:
        dyc[worker[k].name] = op.array(k, reply, "dyc", (n, worker[k].n_kernels, oh, ow))

    def conv_task(k: int) -> Message:
        i = busy.index(worker[k])
        arrays = {}
        for key, around in (("dyc_lo", busy[:i]), ("dyc_hi", busy[i + 1 :])):
            if around:  # the kernels before this worker's, and after
                arrays[key] = _joined([dyc[q.name] for q in around])
        return Message("partial_backward", {"need_dx": conv.need_dx}, arrays)

    # round 2: each worker the others' conv-output gradients, as soon as the master has them;
    # with all of dY_conv, the conv backward through its partial
    ready = lambda k: all(q.name in dyc for q in busy if q.worker != k)  # noqa: E731
    second = op.relay(first, ready, conv_task, arrived)
    mine = None
    if m is not None:
        with op.local():
            whole = be.asarray(_joined([dyc[q.name] for q in busy]))
            dx_m, dw_m, db_m = be.conv2d_backward(whole, kept.master.conv, conv.need_dx)
            mine = {"dx": be.to_numpy(dx_m) if conv.need_dx else None, "dw": be.to_numpy(dw_m), "db": be.to_numpy(db_m)}
    results = op.gather(second.values())

    def part(p: Participant, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return mine[name] if p is m else op.array(p.worker, results[p.worker], name, shape)

    width = {p.name: p.channels.stop - p.channels.start for p in busy}
    k_shape = (conv.kernel, conv.kernel)
    dx = None
    if conv.need_dx:
        dx = be.asarray(np.concatenate([part(p, "dx", (n, width[p.name], h, wd)) for p in busy], axis=1))
    dw = np.concatenate([part(p, "dw", (total, width[p.name], *k_shape)) for p in busy], axis=1)
    db = part(busy[0], "db", (total,))  # every participant's is the same: the first's
    return dx, be.asarray(dw), be.asarray(db)
