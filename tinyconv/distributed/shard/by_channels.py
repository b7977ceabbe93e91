"""An optimisation beside the paper's split: the convolution split by its *input* channels.

A convolution is a sum over its input channels; with participant i holding the channels c_i::

    forward   y_conv = sum_i P_i + b,   P_i = conv(x[:, c_i], w[:, c_i])      (N, F, OH, OW): all F kernels
    backward  dx[:, c_i], dw[:, c_i] = the conv backward of P_i from all of dY_conv;   db from dY_conv alone

so nothing is computed twice. The tail still goes by kernels (``block.py``), so each way takes two rounds
through the master; a worker's round 2 goes out as soon as the others' round 1 is in (:func:`relay`), and a
batch larger than :data:`PIPELINE` goes in chunks. docs/how-it-works.md ("Splitting a convolution by kernels")
has the rounds, what crosses, and what each was measured to gain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.distributed.rpc import Op
from tinyconv.distributed.shard.block import BlockCache, tail_backward, tail_forward, tail_output_hw
from tinyconv.distributed.shard.by_kernels import Grads
from tinyconv.distributed.shard.norm import SplitNorm, joined_grads
from tinyconv.distributed.shard.plan import Participant, Plan
from tinyconv.layers import Conv2D
from transports.base import Message


def per_image(tail: list[dict[str, Any]]) -> bool:
    """Whether the tail treats each image on its own (no batch norm): it may run on a chunk of the batch."""
    return not any(spec["op"] == "bn" for spec in tail)


@dataclass
class ChannelSplitState:
    """What the master's forward of a layer split by input channels keeps for its backward."""

    conv: list[Any]  # the master's conv caches of its partial convolution, one per chunk (none without channels)
    tails: list[BlockCache]  # the master's tail caches, one per tail chunk (none without channels)
    x_shape: tuple[int, ...]
    chunks: list[tuple[int, int]]  # the pipeline's image ranges
    tail_chunks: list[tuple[int, int]]  # the tail's: the same, or the whole batch for one with batch statistics
    norm: tuple[str, ...]  # a batch norm's parameters whose gradients come back (SplitNorm.grads)


@dataclass
class Partial:
    """What the master has of one participant's partial convolution P (F, N, OH, OW), kernel-major:
    P[:lo_end] as ``lo`` and P[hi_start:] as ``hi`` (all of P, for the master's own: lo = P)."""

    lo: np.ndarray | None
    hi: np.ndarray | None
    hi_start: int

    def on(self, kernels: slice) -> np.ndarray:
        """P[kernels], for a range that lies in one of the two parts (a contiguous view)."""
        if self.lo is not None and kernels.stop <= self.lo.shape[0]:
            return self.lo[kernels]
        return self.hi[kernels.start - self.hi_start : kernels.stop - self.hi_start]


# An optimisation, the pipeline: above this many images the batch goes in chunks, so that a chunk's
# partial sums cross the wire while the next chunk computes. 32, not 64: batch 64 then goes in two
# chunks, 1-5 % more speedup at 500:1500 in three runs; at 256 the two are alike (docs/how-it-works.md)
PIPELINE = 32


def halo_sum(s: np.ndarray, own: np.ndarray, others: list[np.ndarray]) -> None:
    """s (N, F', OH, OW) = own + sum(others): a participant's partial over its halo and the others'
    on it, each (F', N, OH, OW) kernel-major, turned to the tail's layout as they are added."""
    if others:
        np.add(own.transpose(1, 0, 2, 3), others[0].transpose(1, 0, 2, 3), out=s)
    else:
        s[...] = own.transpose(1, 0, 2, 3)
    for term in others[1:]:
        s += term.transpose(1, 0, 2, 3)


def _give(active: list[Participant], i: int, total: int) -> list[int]:
    """What the others need of participant i's partial, [lo_end, hi_start]: the kernels up to the
    end of the earlier participants' halos, and from the start of the later ones'."""
    return [
        max((q.halo.stop for q in active[:i]), default=0),
        min((q.halo.start for q in active[i + 1 :]), default=total),
    ]


def owned(be: Backend, d: Array, cache: BlockCache) -> np.ndarray:
    """The owned kernels' channels [lo, hi) of a conv-output gradient from ``block.py``'s tail_backward (host)."""
    lo, hi = cache.own
    return be.to_numpy(d)[:, lo:hi]


def relay(
    op: Op,
    first: dict[int, int],
    ready: Callable[[int], bool],
    then: Callable[[int], list[Message]],
    each: Callable[[int, Message], None],
) -> dict[int, list[int]]:
    """Gather the first round (worker -> task), ``each(worker, result)`` as results come, and send
    worker k its second-round tasks ``then(k)`` as soon as ``ready(k)`` -- which can be before the
    rest of the first round is in, or before its own result is (the optimisation: the second
    round's transfers overlap the first round's compute; the pipeline's chunks overlap the rest).
    Returns the second round, worker -> its tasks in the order sent.
    """
    second: dict[int, list[int]] = {}

    def send_ready() -> None:
        for k in first:
            if k not in second and ready(k):
                second[k] = [op.send(k, msg) for msg in then(k)]

    def arrived(k: int, reply: Message) -> None:
        each(k, reply)
        send_ready()

    send_ready()
    op.gather(first.values(), arrived)
    return second


def chunks(n: int, images: int) -> list[tuple[int, int]]:
    """The batch of ``n`` images cut into near-equal [a, b) ranges of at most ``images`` each (the
    pipeline below); ``images`` 0, or a batch no larger: the whole batch, one range."""
    if images <= 0 or n <= images:
        return [(0, n)]
    k = -(-n // images)
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def forward(
    op: Op, conv: Conv2D, tail: list[dict[str, Any]], plan: Plan, x: Array, norm: SplitNorm, pipeline: int = PIPELINE
) -> tuple[Array, ChannelSplitState]:
    """x (N, C, H, W) -> y (N, F, OH', OW'), the convolution split by input channels, its tail by kernels.

    ``pipeline``: images per chunk of the pipeline (0: the whole batch at once)."""
    be, total, active, m = op.backend, conv.out_channels, plan.active, plan.master
    x_h, w_h, b_h = op.host(x), op.host(conv.params["w"]), op.host(conv.params["b"])
    n, _, oh, ow = conv.output_shape(x_h.shape)
    give = {p.worker: _give(active, i, total) for i, p in enumerate(active) if p.worker is not None}
    with_first = {p.worker: {"b": b_h[p.halo]} | norm.inputs(p.halo) for p in plan.workers}
    parts = chunks(n, pipeline)
    tail_parts = parts if per_image(tail) else [(0, n)]  # the tail goes chunk by chunk, or once all are summed
    tail_at = {te: (ta, te) for ta, te in tail_parts}  # the tail's chunk that image e - 1 completes
    first = _send_partials(op, conv, tail, plan, x_h, w_h, give, parts)  # round 1
    op.chunks = len(parts)  # every transfer of the forward goes by the chunks
    oh2, ow2 = tail_output_hw(oh, ow, tail)
    y = np.empty((n, total, oh2, ow2), np.float32)

    # chunk by chunk, the master's partial, then each worker the others' partials summed over its
    # halo as soon as the master has them (round 2); the master's own halo summed as they come, and
    # its tail run on each chunk summed (or on the whole batch, at the end)
    s_m = w_m = None
    mine: dict[str, Array] = {}
    if m is not None:
        s_m = np.empty((n, m.halo.stop - m.halo.start, oh, ow), np.float32)
        with op.local():
            w_m = be.asarray(np.ascontiguousarray(w_h[:, m.channels]))
            mine = norm.local(be, m.halo)
    conv_m: list[Any] = []
    tails_m: list[BlockCache] = []
    second: dict[int, list[int]] = {k: [] for k in give}
    for (a, e), sent in zip(parts, first, strict=True):
        partials: dict[str, Partial] = {}
        if m is not None:
            with op.local():
                x_m = be.asarray(x_h[a:e, m.channels])  # a view: im2col copies it anyway
                p_m, cache = be.conv2d_partial(x_m, w_m, conv.stride, conv.padding)  # (F, e - a, OH, OW)
                conv_m.append(cache)
                partials[m.name] = Partial(p_m, None, total)
        for k, tasks in _relay_sums(op, plan, give, sent, partials, with_first, (a, e, n), (total, oh, ow)).items():
            second[k] += tasks
        if m is not None:
            with op.local():
                halo_sum(s_m[a:e], partials[m.name].on(m.halo), _others_on(active, partials, m))
                if e in tail_at:
                    ta, te = tail_at[e]
                    s = s_m[ta:te]
                    s += b_h[m.halo, None, None]
                    y_m, cache = tail_forward(be, be.asarray(s), None, tail, m.own, mine)
                    y[ta:te, m.kernels] = be.to_numpy(y_m)
                    tails_m.append(cache)

    results = _gather_y(op, plan, second, parts, tail_at, y)
    norm.fold(op, active, results, mine)  # the last chunk's, with a training batch norm's statistics
    state = ChannelSplitState(conv_m, tails_m, x_h.shape, parts, tail_parts, norm.grads)
    return be.asarray(y), state


def _gather_y(
    op: Op, plan: Plan, second: dict[int, list[int]], parts: list[tuple[int, int]],
    tail_at: dict[int, tuple[int, int]], y: np.ndarray,
) -> dict[int, Message]:  # fmt: skip
    """Each worker's tail_forward results, chunk by chunk (``second``: worker -> its tasks), their y put in its
    kernels of ``y`` (N, F, OH', OW') with each of its tail's chunks (``tail_at``); the last chunk's results."""
    results = {}
    for (_, e), tasks in zip(parts, zip(*second.values(), strict=True), strict=True):
        results = op.gather(tasks)
        if e in tail_at:
            a, e = tail_at[e]
            for p in plan.workers:
                y[a:e, p.kernels] = op.array(p.worker, results[p.worker], "y", (e - a, p.n_kernels, *y.shape[2:]))
    return results


def _send_partials(
    op: Op, conv: Conv2D, tail: list[dict[str, Any]], plan: Plan, x_h: np.ndarray, w_h: np.ndarray,
    give: dict[int, list[int]], parts: list[tuple[int, int]],
) -> list[dict[int, int]]:  # fmt: skip
    """Round 1 of the forward: each worker's partial convolution, every chunk of it at once (w with the
    first). Per chunk, worker -> its task."""
    n, first = x_h.shape[0], []
    for c, (a, e) in enumerate(parts):
        tasks = {}
        for p in plan.workers:
            header = {"stride": conv.stride, "padding": conv.padding, "tail": tail, "images": [a, e, n]}
            header |= {"halo": [p.halo.start, p.halo.stop], "own": list(p.own), "give": give[p.worker]}
            arrays = {"x": np.ascontiguousarray(x_h[a:e, p.channels])}
            arrays |= {"w": np.ascontiguousarray(w_h[:, p.channels])} if c == 0 else {}
            tasks[p.worker] = op.send(p.worker, Message("partial_forward", header, arrays))
        first.append(tasks)
    return first


def _others_on(active: list[Participant], partials: dict[str, Partial], p: Participant) -> list[np.ndarray]:
    """The others' partials over participant p's halo."""
    return [partials[q.name].on(p.halo) for q in active if q is not p]


def _relay_sums(
    op: Op, plan: Plan, give: dict[int, list[int]], sent: dict[int, int], partials: dict[str, Partial],
    with_first: dict[int, dict[str, np.ndarray]], images: tuple[int, int, int], shape: tuple[int, int, int],
) -> dict[int, list[int]]:  # fmt: skip
    """Round 2 of the forward for the chunk of ``images`` [a, e, N]: gather the workers' partials of it
    (``sent``: worker -> its round-1 task) into ``partials``, and send each worker the others' summed
    over its halo (tail_forward; with the first chunk ``with_first[worker]``: b and batch norm's arrays over
    its halo) as soon as they are in. Worker -> its tasks."""
    (a, e, n), (total, oh, ow) = images, shape
    worker = {p.worker: p for p in plan.workers}

    def arrived(k: int, reply: Message) -> None:
        lo_end, hi_start = give[k]
        lo = op.array(k, reply, "p_lo", (lo_end, e - a, oh, ow)) if lo_end > 0 else None
        hi = op.array(k, reply, "p_hi", (total - hi_start, e - a, oh, ow)) if hi_start < total else None
        partials[worker[k].name] = Partial(lo, hi, hi_start)

    def tail_task(k: int) -> list[Message]:
        terms = _others_on(plan.active, partials, worker[k])  # summed to send; one is sent as it is
        arrays = {"sum": sum(terms[1:], terms[0])} if terms else {}
        arrays |= {name: np.ascontiguousarray(v) for name, v in with_first[k].items()} if a == 0 else {}
        return [Message("tail_forward", {"images": [a, e, n]}, arrays)]

    def ready(k: int) -> bool:
        return all(q.name in partials for q in plan.active if q.worker != k)

    return relay(op, sent, ready, tail_task, arrived)


def backward(op: Op, conv: Conv2D, plan: Plan, dy: Array, kept: ChannelSplitState) -> Grads:
    """dy (N, F, OH', OW') -> (dx (N, C, H, W) or None, dw (F, C, K, K), db (F,), dgamma and dbeta (F,)),
    by the forward's plan."""
    be, active, m = op.backend, plan.active, plan.master
    dy_h = be.to_numpy(dy)
    n, c_in, h, wd = kept.x_shape
    _, total, oh, ow = conv.output_shape(kept.x_shape)
    worker = {p.worker: p for p in plan.workers}
    dyc = np.empty((total, n, oh, ow), np.float32)  # all of dY_conv, kernel-major, as each one's own kernels come
    tails: dict[int, Message] = {}  # each worker's round 1, with a batch norm's dgamma, dbeta

    # round 1: each worker's tail backward, every tail chunk of it at once; with the whole batch's tail
    # (batch statistics), the exchange of dyc waits for it, and the op's transfers count as unpipelined
    op.chunks = len(kept.tail_chunks)
    first = [_send_tail_backward(op, worker, dy_h[a:e], [a, e, n]) for a, e in kept.tail_chunks]
    dx = np.empty((n, c_in, h, wd), np.float32) if conv.need_dx else None
    second: dict[int, list[int]] = {k: [] for k in worker}
    grads_m: list[np.ndarray] = []  # the master's [dw, db], summed over the chunks

    # tail chunk by tail chunk: the master's tail backward; round 2, each worker the others' conv-output
    # gradients of the chunk as soon as the master has them; then the master's conv backward of the chunk
    for t, (a, e) in enumerate(kept.tail_chunks):
        have: set[str] = set()
        inside = [(c, ca, ce) for c, (ca, ce) in enumerate(kept.chunks) if a <= ca and ce <= e]  # forward chunks
        if m is not None:
            with op.local():
                d_m = tail_backward(be, be.asarray(dy_h[a:e, m.halo]), kept.tails[t])
                dyc[m.kernels, a:e] = owned(be, d_m, kept.tails[t]).transpose(1, 0, 2, 3)
                have.add(m.name)

        def arrived(k: int, reply: Message, a: int = a, e: int = e, have: set[str] = have) -> None:
            p = worker[k]
            dyc[p.kernels, a:e] = op.array(k, reply, "dyc", (p.n_kernels, e - a, oh, ow))
            tails[k] = reply
            have.add(p.name)

        ready = lambda k, have=have: all(q.name in have for q in active if q.worker != k)  # noqa: E731
        then = lambda k, inside=inside: _conv_tasks(dyc, worker[k], inside, conv.need_dx)  # noqa: E731
        for k, tasks in relay(op, first[t], ready, then, arrived).items():
            second[k] += tasks
        if m is not None:
            _master_conv_backward(op, kept, dyc, dx, inside, m.channels, grads_m)

    width = {p.name: p.channels.stop - p.channels.start for p in active}
    k_shape = (conv.kernel, conv.kernel)
    results = {}
    for (a, e), tasks in zip(kept.chunks, zip(*second.values(), strict=True), strict=True):
        results = op.gather(tasks)  # the last chunk's carry dw and db
        for p in plan.workers if conv.need_dx else []:
            dx[a:e, p.channels] = op.array(p.worker, results[p.worker], "dx", (e - a, width[p.name], h, wd))

    def part(p: Participant, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return grads_m[("dw", "db").index(name)] if p is m else op.array(p.worker, results[p.worker], name, shape)

    dw = np.concatenate([part(p, "dw", (total, width[p.name], *k_shape)) for p in active], axis=1)
    db = part(active[0], "db", (total,))  # every participant's is the same: the first's
    dnorm = joined_grads(op, active, kept.norm, kept.tails[-1].dnorm if kept.tails else {}, tails)
    return None if dx is None else be.asarray(dx), be.asarray(dw), be.asarray(db), dnorm


def _send_tail_backward(op: Op, worker: dict[int, Participant], dy: np.ndarray, images: list[int]) -> dict[int, int]:
    """Round 1 of the backward on one tail chunk, dy (n, F, OH', OW') of its ``images`` [a, b, N]: each worker's
    tail_backward over its halo. Worker -> its task."""
    return {
        k: op.send(k, Message("tail_backward", {"images": images}, {"dy": dy[:, p.halo]})) for k, p in worker.items()
    }


def _conv_tasks(dyc: np.ndarray, p: Participant, inside: list[tuple[int, int, int]], need_dx: bool) -> list[Message]:
    """Worker p's partial_backward tasks on the forward chunks ``inside`` ((chunk, a, e)): the others' rows
    of all of dY_conv ``dyc`` (F, N, OH, OW), those before its own kernels and those after."""
    (total, n), (start, stop), tasks = dyc.shape[:2], (p.kernels.start, p.kernels.stop), []
    for _, a, e in inside:
        arrays = {"dyc_lo": dyc[:start, a:e]} if start > 0 else {}
        arrays |= {"dyc_hi": dyc[stop:, a:e]} if stop < total else {}
        tasks.append(Message("partial_backward", {"need_dx": need_dx, "images": [a, e, n]}, arrays))
    return tasks


def _master_conv_backward(
    op: Op, kept: ChannelSplitState, dyc: np.ndarray, dx: np.ndarray | None, inside: list[tuple[int, int, int]],
    channels: slice, grads: list[np.ndarray],
) -> None:  # fmt: skip
    """The master's conv backward through its partial on the forward chunks ``inside`` ((chunk, a, e), all
    of dY_conv for them in ``dyc`` (F, N, OH, OW)): its columns of dx written into ``dx`` (None: not
    needed), its dw and db added into ``grads`` ([dw, db]; empty before the first chunk)."""
    be = op.backend
    with op.local():
        for c, a, e in inside:
            whole = be.asarray(dyc[:, a:e].transpose(1, 0, 2, 3))  # (N, F, OH, OW), a view
            dx_c, dw_c, db_c = be.conv2d_backward(whole, kept.conv[c], dx is not None)
            if dx is not None:
                dx[a:e, channels] = be.to_numpy(dx_c)
            dw_c, db_c = be.to_numpy(dw_c), be.to_numpy(db_c)
            grads[:] = [dw_c, db_c] if not grads else [grads[0] + dw_c, grads[1] + db_c]
