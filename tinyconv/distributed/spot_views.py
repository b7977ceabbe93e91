"""The spot check's views of one worker's tasks of one layer's step, one per split (``by_kernels.py``,
``by_channels.py``): what the master samples of them.

Their tasks, their samples and the round-off of each entry: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import math

import numpy as np

from backends.base import Backend, conv_output_size
from backends.conformance.checks import float32_tolerance, scale
from tinyconv.distributed import spot_place
from tinyconv.distributed.protocol import NORM_INPUTS
from tinyconv.distributed.replica import probe
from tinyconv.distributed.replica.free_checks import floor
from tinyconv.distributed.shard.block import tail_backward, tail_forward, tail_output_hw
from tinyconv.distributed.shard.by_channels import per_image
from tinyconv.distributed.spot_norm import (
    batch_norm,
    image_backward,
    image_forward,
    norm_backward_pairs,
    norm_forward_pairs,
    norm_gain,
    spread,
    task_norm,
)
from tinyconv.distributed.spot_sample import (
    Pair,
    Sample,
    few_kernels_dw,
    few_kernels_forward,
    fits,
    kernel_span,
    padded,
    pair,
    sum_pair,
    tail_roundings,
)
from transports.base import Message


class ByKernels:
    """A worker's block_forward and block_backward (``block.py``) of one layer's step: a view of it, as
    :class:`ByChannels` is of the other split. ``work``: its forward's kernel-channel-images."""

    def __init__(self, task: Message) -> None:
        self.fwd, h, (x, w) = task, task.header, (task.arrays["x"], task.arrays["w"])
        self.step, self.images = h["step"], x.shape[0]
        self.work = int(np.prod(w.shape[:2])) * self.images
        self.lo, self.hi = h["own"]
        self.conv_hw = tuple(conv_output_size(v, w.shape[2], h["stride"], h["padding"]) for v in x.shape[2:])
        self.m = self.images * int(np.prod(self.conv_hw))  # a batch norm's values per kernel
        self.bn = batch_norm(h["tail"])
        self.y = self.bwd = self.grads = None
        self.stats: dict[str, np.ndarray] = {}  # a training batch norm's: the worker's batch mean and variance (F',)

    def add(self, task: Message, reply: Message) -> str | None:
        """Keep a task and its result: "forward" or "backward" when that is all in, "unfit" for a wrong shape."""
        x, w = self.fwd.arrays["x"], self.fwd.arrays["w"]
        training = self.bn is not None and self.bn["training"]
        if task.kind == "block_forward":
            self.y, self.stats = reply.arrays.get("y"), reply.arrays
            want = {"y": (self.images, self.hi - self.lo, *tail_output_hw(*self.conv_hw, self.fwd.header["tail"]))}
            want |= {"mean": w.shape[:1], "var": w.shape[:1]} if training else {}
            return "forward" if fits(reply, want, " ".join(want)) else "unfit"
        if task.kind != "block_backward" or self.y is None:
            return None
        own = self.hi - self.lo
        want = {"dx": x.shape, "dw": (own, *w.shape[1:]), "db": (own,)}
        want |= {"dgamma": (own,), "dbeta": (own,)} if self.bn is not None else {}
        if not fits(reply, want, " ".join(k for k in want if k != "dx")):
            return "unfit"
        self.bwd, self.grads = task, reply.arrays
        return "backward"

    def floor(self) -> list[tuple[str, float]]:
        """What of its forward's results may not be below 0, and its smallest value (``free_checks.floor``)."""
        return floor(self.y, self.stats, self.fwd.header["tail"])

    def at_one_place(self, after: str, rng: np.random.Generator) -> list[tuple[str, Pair]]:
        """None: all it returns comes through its tail, which one place does not show (``ByChannels.at_one_place``)."""
        return []

    def asks(self, task: Message) -> tuple[int, int] | None:
        """The shape of the dW (own, C K K) that ``task`` may carry a probe of (``replica/probe.py``): a backward."""
        return (self.hi - self.lo, math.prod(self.fwd.arrays["w"].shape[1:])) if task.kind == "block_backward" else None

    def projection(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, int]:
        """Its dW (own, C K K), the probe its backward carried and the sums s, a it answered (None: none), and k of
        their check (``probe.length``)."""
        dw = self.grads["dw"].reshape(self.hi - self.lo, -1)
        return dw, self.bwd.arrays.get("probe"), self.grads.get("probes"), probe.length(self.m, *dw.shape)

    def places(self, kind: str) -> range:
        """Where a sample of ``kind`` may be: the images, or the kernels it answers for."""
        return range(self.images) if kind == "image" else range(self.lo, self.hi)

    def alike(self, sample: Sample) -> range:
        """Where another sample checks what ``sample`` does (any place of its kind, by kernels)."""
        return self.places(sample.kind)

    def sample(self, kind: str, at: int, be: Backend) -> Sample:
        """The sample of ``kind`` at ``at``, the master's forward of it computed."""
        x, w, b, h = self.fwd.arrays["x"], self.fwd.arrays["w"], self.fwd.arrays["b"], self.fwd.header
        if kind == "image":
            args = (be.asarray(x[at : at + 1]), be.asarray(w), be.asarray(b), h["stride"], h["padding"])
            conv, conv_cache = be.conv2d_forward(*args)
            top = scale(be.to_numpy(conv))  # before the tail, which may write in place
            norm = task_norm(be, self.fwd.arrays, slice(0, w.shape[0]))
            y, cache = image_forward(be, conv, conv_cache, h["tail"], norm, self.stats, self.m, (self.lo, self.hi))
            return Sample(kind, at, slice(0, w.shape[0]), np.asarray(be.to_numpy(y)), cache, top, norm=norm)
        span = kernel_span(at, w.shape[0], h["tail"])  # clipped where the task's kernels end: its true edge
        xp = padded(x, h["padding"])
        conv = few_kernels_forward(xp, w[span], b[span], h["stride"])
        norm = task_norm(be, self.fwd.arrays, span)
        y, cache = tail_forward(be, be.asarray(conv), None, h["tail"], (at - span.start, at - span.start + 1), norm)
        return Sample(kind, at, span, np.asarray(be.to_numpy(y)), cache, scale(conv), xp, norm=norm)

    def forward_pairs(self, sample: Sample, be: Backend) -> list[Pair]:
        got = self.y[sample.at : sample.at + 1] if sample.kind == "image" else self.y[:, _at(sample, self.lo)]
        k, gain = forward_roundings(self.fwd, self.m), norm_gain(be, self.fwd.header["tail"], sample.norm, self.m)
        pairs = [pair(got, sample.y, k, sample.top * gain)]  # a batch norm scales the convolution's round-off
        if sample.kind == "kernel" and self.bn is not None and self.bn["training"]:
            stats = {name: self.stats[name][sample.at : sample.at + 1] for name in ("mean", "var")}
            pairs += norm_forward_pairs(be, sample, stats, k - tail_roundings(self.fwd.header["tail"], self.m), self.m)
        return pairs

    def backward_pairs(self, sample: Sample, be: Backend) -> list[Pair]:
        dy, h = self.bwd.arrays["dy"], self.fwd.header
        f, _, kh, kw = self.fwd.arrays["w"].shape
        k = forward_roundings(self.fwd, self.m) + tail_roundings(h["tail"], self.m)
        if sample.kind == "image":  # its dx, the only number an image's backward gives
            if not (self.bwd.header["need_dx"] and "dx" in self.grads):
                return []
            dnorm = spread(self.grads, f, (self.lo, self.hi))
            d = image_backward(be, be.asarray(dy[sample.at : sample.at + 1]), sample.cache, dnorm)
            if d is None:
                return []
            dx, _, _ = be.conv2d_backward(d, sample.cache.conv, True)
            return [pair(self.grads["dx"][sample.at : sample.at + 1], np.asarray(be.to_numpy(dx)), k + f * kh * kw)]
        d = np.asarray(be.to_numpy(tail_backward(be, be.asarray(dy[:, sample.span]), sample.cache)))
        d = d[:, sample.at - sample.span.start][:, None]  # (N, 1, OH, OW): the kernel's conv-output gradient
        j = _at(sample, self.lo)
        pairs = []
        if self.bn is not None:
            got = {name: self.grads[name][j] for name in ("dgamma", "dbeta")}
            pairs = norm_backward_pairs(be, sample, self.bn, got, dy[:, sample.at], k, self.m)
        k += self.m  # dw and db sum over every conv output
        dw = few_kernels_dw(sample.xp, d, h["stride"], kh)
        return [*pairs, pair(self.grads["dw"][j], dw, k), sum_pair(self.grads["db"][j], d, k)]


def forward_roundings(task: Message, m: int) -> int:
    """k of a block's output: the convolution's C K K products and its bias, then the tail (m: a batch norm's values
    per kernel)."""
    _, c, kh, kw = task.arrays["w"].shape
    return c * kh * kw + 1 + tail_roundings(task.header["tail"], m)


def _at(sample: Sample, lo: int) -> slice:
    """A kernel sample's channel in a result whose kernels start at ``lo``."""
    return slice(sample.at - lo, sample.at - lo + 1)


class ByChannels:
    """A worker's tasks of one layer's step split by input channels, from its first partial_forward on."""

    def __init__(self, task: Message) -> None:
        h, x = task.header, task.arrays["x"]
        self.h, self.w, self.tail = h, task.arrays["w"], h["tail"]  # w (F, c, K, K)
        self.step, self.images = h["step"], h["images"][2]
        self.f, self.c, self.k = self.w.shape[:3]
        self.work = self.f * self.c * self.images
        self.hs, self.he = h["halo"]
        self.start, self.end = self.hs + h["own"][0], self.hs + h["own"][1]  # its own kernels, of the F
        self.x_shape = x.shape[1:]
        self.conv_hw = tuple(conv_output_size(v, self.k, h["stride"], h["padding"]) for v in x.shape[2:])
        self.chunks: list[tuple[int, int]] = []
        self.x, self.p, self.sums, self.around, self.dx = [], [], [], [], []
        self.ys, self.dys, self.dycs = [], [], []  # y, dy and dyc chunk by chunk, until the batch is whole
        self.b = self.y = self.dy = self.dyc = self.dw = self.db = self.probes = None
        self.need_dx = False
        self.bn, self.m = batch_norm(self.tail), self.images * int(np.prod(self.conv_hw))
        # a batch norm's arrays over its halo, as the first tail_forward brought them
        self.norm: dict[str, np.ndarray] = {}
        # the worker's: a training batch norm's batch mean and variance, dgamma, dbeta
        self.stats: dict[str, np.ndarray] = {}

    def add(self, task: Message, reply: Message) -> str | None:
        a, r, (oh, ow), n = task.arrays, reply.arrays, self.conv_hw, self.images
        if task.kind == "partial_forward":
            first, stop, _ = task.header["images"]
            rows = {"p_lo": self.h["give"][0], "p_hi": self.f - self.h["give"][1]}
            if not fits(reply, {name: (m, stop - first, oh, ow) for name, m in rows.items()}):
                return "unfit"
            self.chunks.append((first, stop))
            self.x.append(a["x"])
            self.p.append(r)
        elif task.kind == "tail_forward":
            self.sums.append(a.get("sum"))
            if "b" in a:  # the first chunk's, with batch norm's arrays over its halo
                self.b, self.norm = a["b"], {k: a[k] for k in NORM_INPUTS if k in a}
            first, stop, _ = task.header["images"]
            if "y" in r:  # a chunk's y (the whole batch's, after the last chunk, for a tail with batch statistics)
                halo, own = (self.he - self.hs,), (self.end - self.start,)
                rows = stop - first if per_image(self.tail) else n
                want = {"y": (rows, *own, *tail_output_hw(oh, ow, self.tail))}
                want |= {"mean": halo, "var": halo} if self.bn is not None and self.bn["training"] else {}
                if not fits(reply, want, " ".join(want)):
                    return "unfit"
                self.ys.append(r["y"])
                self.stats = dict(r)
            if stop == n and self.ys:
                self.y = np.concatenate(self.ys)
                return "forward"
        elif task.kind == "tail_backward" and self.y is not None:
            first, stop, _ = task.header.get("images", [0, n, n])
            if first == 0:
                self.dys, self.dycs, self.around, self.dx = [], [], [], []
            own = (self.end - self.start,)
            want = {"dyc": (*own, stop - first, oh, ow)}
            want |= {"dgamma": own, "dbeta": own} if self.bn is not None else {}
            if not fits(reply, want, " ".join(want)):
                return "unfit"
            self.dys.append(a["dy"])
            self.dycs.append(r["dyc"])
            self.stats |= {k: r[k] for k in ("dgamma", "dbeta") if k in r}
            if stop == n:
                self.dy, self.dyc = np.concatenate(self.dys), np.concatenate(self.dycs, axis=1)
        elif task.kind == "partial_backward" and self.dyc is not None:
            first, stop, _ = task.header["images"]
            self.need_dx = task.header["need_dx"]
            if not fits(reply, {"dx": (stop - first, *self.x_shape), "dw": self.w.shape, "db": (self.f,)}):
                return "unfit"
            self.around.append(a)
            self.dx.append(r.get("dx"))
            if "dw" in r and "db" in r:
                self.dw, self.db, self.probes = r["dw"], r["db"], r.get("probes")
                return "backward"
        return None

    def floor(self) -> list[tuple[str, float]]:
        """As :meth:`ByKernels.floor`."""
        return floor(self.y, self.stats, self.tail)

    def at_one_place(self, after: str, rng: np.random.Generator) -> list[tuple[str, Pair]]:
        """After the ``forward``, the rows of P it sent (p_lo, p_hi) at one image, row and column; after the
        ``backward``, its dx at one, from all of dY_conv as the worker had it (``spot_place.py``); each held to the
        rigorous bound on its terms' sizes (k: c K K products; F K K, col2im's K K and 2 more)."""
        n = int(rng.integers(self.images))
        (i, j), s, pad = self._chunk(n), self.h["stride"], self.h["padding"]
        if after == "forward" and self.h["give"] != [0, self.f]:
            lo_end, hi_start = self.h["give"]
            r, c = (int(rng.integers(v)) for v in self.conv_hw)
            ref, terms = spot_place.output_at(self.w, self.x[i][j], r, c, s, pad)
            got = np.concatenate([self.p[i][name][:, j, r, c] for name in ("p_lo", "p_hi") if name in self.p[i]])
            rows, k = np.r_[0:lo_end, hi_start : self.f], self.c * self.k * self.k
            return [
                (
                    f"its partial convolution of image {n} at ({r}, {c})",
                    (got, ref[rows], float32_tolerance(k, terms[rows])),
                )
            ]
        if after == "forward" or not (self.need_dx and self.dx[i] is not None):
            return []
        r, c = (int(rng.integers(v)) for v in self.x_shape[1:])
        ref, terms = spot_place.dx_at(self.w, self._dy_conv_image(n)[0], r, c, s, pad)
        tol = float32_tolerance(self.f * self.k * self.k + self.k * self.k + 2, terms)
        return [(f"its dx of image {n} at ({r}, {c})", (self.dx[i][j, :, r, c], ref, tol))]

    def asks(self, task: Message) -> tuple[int, int] | None:
        """The shape of the dW (F, c K K) that ``task`` may carry a probe of (``replica/probe.py``): its backward's
        first chunk's."""
        first = task.kind == "partial_backward" and task.header.get("images", [0])[0] == 0
        return (self.f, self.c * self.k * self.k) if first else None

    def projection(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, int]:
        """As :meth:`ByKernels.projection`, dW (F, c K K) summed over the chunks: one rounding more each."""
        dw = self.dw.reshape(self.f, -1)
        return dw, self.around[0].get("probe"), self.probes, probe.length(self.m, *dw.shape) + len(self.chunks)

    def places(self, kind: str) -> range:
        return range(self.images if kind == "image" else self.f)

    def alike(self, sample: Sample) -> range:
        """Where another sample checks what ``sample`` does: a kernel it owns checks its y, dyc (and batch norm's)."""
        owns = sample.kind == "kernel" and self.start <= sample.at < self.end
        return range(self.start, self.end) if owns else self.places(sample.kind)

    def sample(self, kind: str, at: int, be: Backend) -> Sample:
        stride, pad = self.h["stride"], self.h["padding"]
        if kind == "image":
            i, r = self._chunk(at)
            p, conv = be.conv2d_partial(be.asarray(self.x[i][r : r + 1]), be.asarray(self.w), stride, pad)
            p = np.asarray(be.to_numpy(p))  # (F, 1, OH, OW)
            halo = slice(self.hs, self.he)
            s = p[halo].transpose(1, 0, 2, 3) + self._sum(halo, at, at + 1) + self.b[None, :, None, None]
            top = max(scale(p), scale(s))  # its partial's scale, and the sum's, before the tail
            norm = task_norm(be, self.norm, slice(0, self.he - self.hs))
            own = tuple(self.h["own"])
            y, cache = image_forward(be, be.asarray(s), conv, self.tail, norm, self.stats, self.m, own)
            return Sample(kind, at, halo, np.asarray(be.to_numpy(y)), cache, top, partial=p, norm=norm)
        xp = padded(np.concatenate(self.x), pad)
        if not self.start <= at < self.end:  # a kernel it owns no output of: the row of P it sent, its dw and db
            p = few_kernels_forward(xp, self.w[at : at + 1], np.zeros(1, np.float32), stride)
            return Sample(kind, at, slice(at, at + 1), None, None, xp=xp, partial=p[:, 0])
        span = kernel_span(at, self.f, self.tail)
        conv = few_kernels_forward(xp, self.w[span], np.zeros(span.stop - span.start, np.float32), stride)
        s = conv + self._sum(span, 0, self.images) + self.b[span.start - self.hs : span.stop - self.hs, None, None]
        top = max(scale(conv), scale(s))
        norm = task_norm(be, self.norm, slice(span.start - self.hs, span.stop - self.hs))
        y, cache = tail_forward(be, be.asarray(s), None, self.tail, (at - span.start, at - span.start + 1), norm)
        return Sample(kind, at, span, np.asarray(be.to_numpy(y)), cache, top, xp, norm=norm)

    def forward_pairs(self, sample: Sample, be: Backend) -> list[Pair]:
        k = self.c * self.k * self.k
        if sample.kind == "kernel" and sample.y is None:  # a row the others' halos read: in p_lo or p_hi
            lo_end, hi_start = self.h["give"]
            name, row = ("p_lo", sample.at) if sample.at < lo_end else ("p_hi", sample.at - hi_start)
            return [pair(np.concatenate([p[name][row] for p in self.p]), sample.partial, k)]
        k_y, top = k + 2 + tail_roundings(self.tail, self.m), sample.top * norm_gain(be, self.tail, sample.norm, self.m)
        if sample.kind == "kernel":
            own = slice(sample.at - self.start, sample.at - self.start + 1)
            pairs = [pair(self.y[:, own], sample.y, k_y, top)]
            if self.bn is not None and self.bn["training"]:
                stats = {
                    name: self.stats[name][sample.at - self.hs : sample.at - self.hs + 1] for name in ("mean", "var")
                }
                pairs += norm_forward_pairs(be, sample, stats, k + 2, self.m)
            return pairs
        i, r = self._chunk(sample.at)
        lo_end, hi_start = self.h["give"]
        pairs = [pair(self.y[sample.at : sample.at + 1], sample.y, k_y, top)]
        if "p_lo" in self.p[i]:
            pairs.append(pair(self.p[i]["p_lo"][:, r], sample.partial[:lo_end, 0], k))
        if "p_hi" in self.p[i]:
            pairs.append(pair(self.p[i]["p_hi"][:, r], sample.partial[hi_start:, 0], k))
        return pairs

    def backward_pairs(self, sample: Sample, be: Backend) -> list[Pair]:
        k_dyc = self.c * self.k * self.k + 2 + 2 * tail_roundings(self.tail, self.m)
        rows = slice(sample.span.start - self.hs, sample.span.stop - self.hs)  # the sample's kernels in dy's halo
        if sample.kind == "image":
            n, (lo, hi) = sample.at, self.h["own"]
            pairs = []
            dnorm = spread(self.stats, self.he - self.hs, (lo, hi))
            d = image_backward(be, be.asarray(self.dy[n : n + 1, rows]), sample.cache, dnorm)
            if d is not None:
                pairs.append(pair(self.dyc[:, n], np.asarray(be.to_numpy(d))[0, lo:hi], k_dyc))
            i, r = self._chunk(n)
            if self.need_dx and self.dx[i] is not None:
                dx, _, _ = be.conv2d_backward(be.asarray(self._dy_conv_image(n)), sample.cache.conv, True)
                pairs.append(pair(self.dx[i][r : r + 1], np.asarray(be.to_numpy(dx)), self.f * self.k * self.k))
            return pairs
        pairs, j = [], sample.at
        if sample.y is not None:
            d = np.asarray(be.to_numpy(tail_backward(be, be.asarray(self.dy[:, rows]), sample.cache)))
            pairs.append(pair(self.dyc[j - self.start], d[:, j - sample.span.start], k_dyc))
            if self.bn is not None:
                got = {name: self.stats[name][j - self.start : j - self.start + 1] for name in ("dgamma", "dbeta")}
                pairs += norm_backward_pairs(be, sample, self.bn, got, self.dy[:, j - self.hs], k_dyc, self.m)
        row = self._dy_conv_row(j)  # (N, OH, OW)
        dw = few_kernels_dw(sample.xp, row[:, None], self.h["stride"], self.k)
        k = row.size + len(self.chunks)
        return [*pairs, pair(self.dw[j : j + 1], dw, k), sum_pair(self.db[j : j + 1], row, k)]

    def _chunk(self, n: int) -> tuple[int, int]:
        """Image n's chunk, and its place in it."""
        return next((i, n - a) for i, (a, e) in enumerate(self.chunks) if a <= n < e)

    def _sum(self, kernels: slice, a: int, e: int) -> np.ndarray | float:
        """The others' partials the master sent over ``kernels`` (of F) for images [a, e): (e - a, kernels, OH, OW)."""
        rows = slice(kernels.start - self.hs, kernels.stop - self.hs)
        parts = [
            s[rows, max(a, ca) - ca : min(e, ce) - ca]
            for (ca, ce), s in zip(self.chunks, self.sums, strict=True)
            if s is not None and ca < e and a < ce
        ]
        return np.concatenate(parts, axis=1).transpose(1, 0, 2, 3) if parts else 0.0

    def _dy_conv_row(self, j: int) -> np.ndarray:
        """dY_conv[j] (N, OH, OW) as the worker had it: its own answer, or the others' rows the master sent."""
        if self.start <= j < self.end:
            return self.dyc[j - self.start]
        name, row = ("dyc_lo", j) if j < self.start else ("dyc_hi", j - self.end)
        return np.concatenate([a[name][row] for a in self.around])

    def _dy_conv_image(self, n: int) -> np.ndarray:
        """dY_conv of image n (1, F, OH, OW) as the worker had it."""
        i, r = self._chunk(n)
        around = self.around[i]
        lo = [around["dyc_lo"][:, r]] if "dyc_lo" in around else []
        hi = [around["dyc_hi"][:, r]] if "dyc_hi" in around else []
        return np.concatenate([*lo, self.dyc[:, n], *hi])[None]
