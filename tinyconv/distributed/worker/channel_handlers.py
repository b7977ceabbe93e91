"""The worker's side of a layer split by its input channels (``tinyconv/distributed/shard/by_channels.py``).

Four tasks, one layer's step, each checked against its schema (``protocol.py``) first; their headers and arrays,
and how a batch goes in chunks of images (header ``images`` = [a, b, N]): docs/how-it-works.md, "The tasks of the
other splits". What crosses of the conv output is kernel-major, (kernels, N, OH, OW).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinyconv.distributed.protocol import NORM_INPUTS, TaskError
from tinyconv.distributed.replica import probe
from tinyconv.distributed.shard.block import tail_backward as run_tail_backward
from tinyconv.distributed.shard.block import tail_forward as run_tail
from tinyconv.distributed.shard.by_channels import halo_sum, owned, per_image
from tinyconv.distributed.worker.state import (
    Handler,
    OpenStep,
    WorkerState,
    checked_tail,
    header_span,
    norm_arrays,
    task_place,
    task_slot,
)
from transports.wire import Int


def partial_forward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """P (F, N, OH, OW), the partial convolution of its input channels for all F kernels, on a chunk
    of images; returns the parts the others need (p_lo = P[:lo_end], p_hi = P[hi_start:]) and keeps
    P over its halo, P[cs:ce], until tail_forward sums it."""
    x, w = a["x"], a.get("w")
    first, stop, n = _images(h, x.shape[0])
    if x.ndim != 4 or stop - first != x.shape[0] or (w is not None and (w.ndim != 4 or x.shape[1] != w.shape[1])):
        raise TaskError(
            f"layer {h['layer']}: expected x ({stop - first}, c, H, W) for images [{first}, {stop}) and "
            f"w (F, c, KH, KW), got x {x.shape}" + (f", w {w.shape}" if w is not None else "")
        )
    settings = [h[key] for key in ("stride", "padding", "tail", "halo", "own", "give")] + [list(x.shape[1:]), n]
    if first == 0:
        if w is None:
            raise TaskError(f"layer {h['layer']}: the first chunk of partial_forward (image 0 on) brings w")
        f = w.shape[0]
        tail = checked_tail(h, x.shape[2:], w.shape[2:])
        cs, ce = header_span(h, "halo", f)
        own = header_span(h, "own", ce - cs)
        give = h["give"]
        if not (isinstance(give, list) and len(give) == 2 and all(Int.accepts(v) and 0 <= v <= f for v in give)):
            raise TaskError(f"layer {h['layer']}: give must be [lo_end, hi_start] within [0, {f}], got {give!r}")
        kept = OpenStep("partial", h["step"], conv=[], tail=tail, own=own, kernels=f, w=w, probe={"x": []})
        kept.settings, kept.halo = settings, (cs, ce)
    else:
        kept = state.open.get(task_slot(h))
        if kept is None or kept.stage != "partial" or kept.step != h["step"] or kept.chunks[-1][1] != first:
            raise TaskError(
                f"{task_place(h)}: partial_forward of images from {first} on continues the chunk that ends there; "
                "send the batch's chunks in order from image 0"
            )
        if w is not None:
            raise TaskError(f"{task_place(h)}: w comes with the first chunk of partial_forward only")
        if settings != kept.settings:
            raise TaskError(f"{task_place(h)}: a chunk of partial_forward must repeat its first chunk's settings")
    f, (cs, ce) = kept.kernels, kept.halo
    p, conv = state.backend.conv2d_partial(x, kept.w, h["stride"], h["padding"])
    if first == 0:
        kept.summed = np.empty((n, ce - cs, *p.shape[2:]), np.float32)
    kept.partial.append(p[cs:ce])  # a view; p is not written again, so the parts below go out uncopied
    kept.conv.append(conv)
    kept.probe["x"].append(x)
    kept.chunks.append((first, stop))
    state.advance(h, "partial_forward", kept)
    lo_end, hi_start = h["give"]
    return ({"p_lo": p[:lo_end]} if lo_end > 0 else {}) | ({"p_hi": p[hi_start:]} if hi_start < f else {})


def tail_forward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], kept: OpenStep) -> dict[str, Any]:
    """Adds ``sum`` (F', N, OH, OW), the others' partials on its halo, to a chunk of its own (``b`` and batch
    norm's arrays come with the first); y = tail(P[halo] + sum + b) of its own kernels, on each chunk as it
    is summed when the tail treats images on their own (``by_channels.per_image``), else on the whole batch with
    the last."""
    n, computed, oh, ow = kept.summed.shape
    first, stop = _next_chunk(h, kept.chunks, kept.done, n, "tail_forward goes by partial_forward's chunks")
    b, others = a.get("b"), a.get("sum")
    rows = (computed, stop - first, oh, ow)
    if (b is not None and b.shape != (computed,)) or (others is not None and others.shape != rows):
        got = (f"b {b.shape}, " if b is not None else "") + (f"sum {others.shape}" if others is not None else "")
        raise TaskError(f"layer {h['layer']}: tail_forward takes b ({computed},) and sum {rows}; got {got}")
    if (b is not None) != (first == 0) or (first > 0 and any(k in a for k in NORM_INPUTS)):
        raise TaskError(
            f"layer {h['layer']}: b (and batch norm's arrays) come with the first chunk of tail_forward "
            "(images from 0) only"
        )
    if first == 0:
        kept.b, kept.norm = b, norm_arrays(kept.tail, a, computed, f"layer {h['layer']}")
    halo_sum(kept.summed[first:stop], kept.partial[kept.done], [] if others is None else [others])
    kept.partial[kept.done] = None  # summed: its P can go
    kept.done += 1
    whole = not per_image(kept.tail)
    if whole and stop < n:
        return {}
    s = kept.summed[0 if whole else first : stop]
    s += kept.b[None, :, None, None]
    norm = {k: state.backend.asarray(v) for k, v in kept.norm.items()}
    y, cache = run_tail(state.backend, state.backend.asarray(s), None, kept.tail, kept.own, norm)
    kept.tails.append(cache)
    if stop == n:
        kept.partial, kept.summed, kept.done = [], None, 0
        state.advance(h, "tail_forward", kept)
    return {"y": y} | {k: norm[k] for k in ("mean", "var") if k in norm}  # a training batch norm's statistics


def tail_backward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], kept: OpenStep) -> dict[str, Any]:
    """dyc (own, N, OH, OW), its own kernels' conv-output gradient, from dy over its halo, by the tail's
    chunks; kept, in its rows of all of dY_conv (F, N, OH, OW), for partial_backward to fill in the others'."""
    be, n = state.backend, kept.chunks[-1][1]
    spans = kept.chunks if per_image(kept.tail) else [(0, n)]  # the tail's chunks
    first, stop = _next_chunk(h, spans, kept.done, n, "tail_backward goes by the tail's chunks")
    cache = kept.tails[kept.done]
    try:
        d = run_tail_backward(be, a["dy"], cache)
    except ValueError as e:
        raise TaskError(f"layer {h['layer']} step {h['step']}: {e}") from None
    d = owned(be, d, cache)  # (images, own, OH, OW)
    start, end = _own_kernels(kept)
    if first == 0:
        kept.dyc = np.empty((kept.kernels, n, *d.shape[2:]), np.float32)
    kept.dyc[start:end, first:stop] = d.transpose(1, 0, 2, 3)
    kept.done += 1
    if stop == n:
        kept.done = 0  # chunks through partial_backward
        state.advance(h, "tail_backward", kept)
    dnorm = {"d" + k: v for k, v in cache.dnorm.items()}  # batch norm's dgamma, dbeta
    return {"dyc": kept.dyc[start:end, first:stop]} | dnorm  # rows partial_backward leaves; a whole batch's uncopied


def partial_backward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], kept: OpenStep) -> dict[str, Any]:
    """With the others' dyc before and after its own (dyc_lo, dyc_hi: all of dY_conv, F x N), the
    conv backward through its partial, one forward chunk at a time: the chunk's dx of its input
    channels (if need_dx); dw (F, c, K, K) and db (F,), summed over the chunks, with the last, and asked a
    ``probe`` (u, v) with the first, the sums s, a of that dw along them (``replica/probe.py``)."""
    f, n, oh, ow = kept.dyc.shape
    first, stop = _next_chunk(h, kept.chunks, kept.done, n, "partial_backward goes by the forward's chunks")
    ckk = tuple(kept.w.shape[1:])
    if "probe" in a and (first > 0 or a["probe"].shape != (f + math.prod(ckk),)):
        raise TaskError(
            f"layer {h['layer']}: a probe, u ({f},) then v {ckk}, comes with the first chunk (images from 0)"
        )
    start, end = _own_kernels(kept)
    around = {"dyc_lo": slice(0, start), "dyc_hi": slice(end, f)}  # the others' kernels: rows of dY_conv
    for key, rows in around.items():
        part, want = a.get(key), (rows.stop - rows.start, stop - first, oh, ow)
        if (part is None) != (want[0] == 0) or (part is not None and part.shape != want):
            raise TaskError(
                f"layer {h['layer']}: partial_backward takes the others' dyc around this worker's kernels "
                f"[{start}, {end}) of {f}, dyc_lo those before and dyc_hi those after: {key} must be "
                f"{want if want[0] else 'absent'}, got {'nothing' if part is None else tuple(part.shape)}"
            )
    for key, rows in around.items():
        if key in a:
            kept.dyc[rows, first:stop] = a[key]
    be = state.backend
    whole = kept.dyc[:, first:stop].transpose(1, 0, 2, 3)  # (images, F, OH, OW), a view
    dx, dw, db = be.conv2d_backward(be.asarray(whole), kept.conv[kept.done], h["need_dx"])
    if "probe" in a:
        kept.probe |= {"u": a["probe"][:f], "v": a["probe"][f:].reshape(ckk), "sums": np.zeros(2)}
    if "u" in kept.probe:  # its dw's sums along the probe (replica/probe.py), chunk by chunk
        x = be.to_numpy(kept.probe["x"][kept.done])
        kept.probe["sums"] += probe.sums(x, whole, kept.probe["u"], kept.probe["v"], *kept.settings[:2])
    kept.done += 1
    if len(kept.chunks) > 1:  # summed over the chunks on the host
        dw, db = be.to_numpy(dw), be.to_numpy(db)
        kept.dw, kept.db = (dw, db) if kept.dw is None else (kept.dw + dw, kept.db + db)
        dw, db = kept.dw, kept.db
    out = {"dx": dx} if h["need_dx"] else {}
    if kept.done < len(kept.chunks):
        return out
    state.advance(h, "partial_backward", kept)
    return {"dw": dw, "db": db} | out | ({"probes": kept.probe["sums"].astype(np.float32)} if "u" in kept.probe else {})


def _own_kernels(kept: OpenStep) -> tuple[int, int]:
    """Its own kernels' range [start, stop) among all F."""
    return kept.halo[0] + kept.own[0], kept.halo[0] + kept.own[1]


def _images(h: dict[str, Any], n: int) -> tuple[int, int, int]:
    """Header ``images`` = [a, b, N], a chunk of a batch of N, checked; absent: (0, n, n), the whole batch."""
    v = h.get("images", [0, n, n])
    if not (isinstance(v, list) and len(v) == 3 and all(Int.accepts(i) for i in v) and 0 <= v[0] < v[1] <= v[2]):
        raise TaskError(f"{task_place(h)}: images must be [a, b, N] with 0 <= a < b <= N, got {v!r}")
    return v[0], v[1], v[2]


def _next_chunk(h: dict[str, Any], spans: list[tuple[int, int]], done: int, n: int, rule: str) -> tuple[int, int]:
    """The task's chunk [a, b) of the batch of ``n``, which must be ``spans[done]``."""
    chunk = spans[done] if done < len(spans) else None
    if chunk is None or _images(h, n) != (*chunk, n):
        nxt = f"images {[*chunk, n]}" if chunk else f"a chunk after images {spans[-1][1]}, not computed yet"
        raise TaskError(f"{task_place(h)}: {rule}; the next is {nxt}")
    return chunk


# the inputs these handlers only hand to the backend (handler.ON_BACKEND)
ON_BACKEND = {"partial_forward": frozenset({"x", "w"}), "tail_backward": frozenset({"dy"})}
HANDLERS: dict[str, Handler] = {
    "partial_forward": partial_forward,
    "tail_forward": tail_forward,
    "tail_backward": tail_backward,
    "partial_backward": partial_backward,
}
