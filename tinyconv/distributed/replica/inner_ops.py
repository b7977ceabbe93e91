"""The worker's backward checked inside, op by op: a wrong batch norm, LRN or convolution dx, which every sum the
worker makes below it then follows (dW, its projection, each image's e_j).

Batch norm, by two sums. In training its backward is, per channel, dx = g (dy - dbeta / M - xhat dgamma / M), g =
gamma / std, M = n H W, dbeta = sum dy, dgamma = sum dy xhat (``layers.BatchNorm2D``). Multiplied by dy and summed:

    sum dx dy = g (e - dbeta^2 / M - dgamma^2 / M),    e = sum dy^2,

exactly. The worker returns sum dx dy and e per channel; the master checks the identity from the dbeta and dgamma
in the gradient it sent and g from gamma and the batch variance it returned (``stats``). Neither side cancels (sum
dx dy = g |P dy|^2, P the projection off 1 and xhat), so dx 1 % off moves it 1 %.

A convolution's dX, at one position: dX[i, :, r, c] = sum_(f, a, b) W[f, :, a, b] dY[i, f, (r + p - a) / s,
(c + p - b) / s], over the taps that land on an output. The worker returns dX there and that window of dY (zeros
off the map), at the image, row and column the master drew (the probe's last ``probe.WHERE`` numbers, fractions;
from there, the first position where dX is not all 0), and the master multiplies out W times the window itself.

An LRN's dx, at one position: the worker returns the position, and there the LRN's input (its run's: a ReLU's
before it), dy and dx, C numbers each, and the master computes dx from the first two (``lrn_column``). Where the
LRN is the hybrid's last, a max pool alone after it, its output there is also the feature of each pool window
that took it (``took``): the features the worker sent, tied to its own LRN input.

The first two are held to the projections' probabilistic bound (``probe.tolerance``), the LRN's few roundings to
the rigorous one; their k and terms, and what they catch: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import functools

import numpy as np

from backends.conformance.checks import FN, float32_tolerance
from tinyconv.distributed.replica import flat, probe
from tinyconv.distributed.replica.conv_part import conv_part
from tinyconv.distributed.spot_sample import Pair
from tinyconv.layers import BatchNorm2D, Conv2D, LocalResponseNorm, MaxPool2D
from tinyconv.model import Network
from transports.base import Message


def sampled(net: Network) -> list[Conv2D]:
    """The network's convolutions that compute dX, in order: C + F K K numbers each."""
    return [layer for layer in probe.convs(net) if layer.need_dx]


def position(dx: np.ndarray, where: np.ndarray) -> tuple[int, int, int]:
    """The image, row and column of dx (n, C, H, W) that ``where`` (the probe's last ``probe.WHERE`` numbers,
    fractions) points at, or from there the first where dx is not all 0 (a sparse dY, after a max pool and ReLU,
    leaves whole windows empty: nothing to see there)."""
    extents = np.take(dx.shape, [0, 2, 3])
    i, r, c = (int(np.nan_to_num(abs(f)) * e) % e for f, e in zip(where, extents, strict=True))
    live = np.flatnonzero(np.any(dx[i] != 0, axis=0))
    if live.size:
        r, c = divmod(int(live[np.searchsorted(live, r * dx.shape[3] + c) % live.size]), dx.shape[3])
    return i, r, c


def sums(net: Network, where: np.ndarray, inputs: dict[str, np.ndarray], douts: dict[str, np.ndarray]) -> np.ndarray:
    """The worker's: (sum dx dy, e) per channel of each batch norm, (2 C,) each; each LRN's position (``position``:
    its image, row and column) and its input, dy and dx there, (3 + 3 C,); each dX-computing convolution's dX at
    one position and its window of dY, (C + F K K,); float32. From the input each LRN got (``Network.forward``'s
    ``seen``: its run's, a ReLU's before it) and the gradient each layer got and gave (``Network.backward``'s: 'bn1'
    and 'bn1.dx'), each sum one BLAS dot a row."""
    out = []
    for norm in (layer for layer in net.layers if isinstance(layer, BatchNorm2D)):
        dy, dx = douts[norm.name], douts[f"{norm.name}.dx"]
        n, c = dy.shape[:2]
        out += [(a.reshape(n, c, 1, -1) @ dy.reshape(n, c, -1, 1)).sum(axis=(0, 2, 3)) for a in (dx, dy)]
    for lrn in (layer for layer in net.layers if isinstance(layer, LocalResponseNorm)):
        i, r, c = position(douts[f"{lrn.name}.dx"], where)
        columns = (a[i, :, r, c] for a in (inputs[lrn.name], douts[lrn.name], douts[f"{lrn.name}.dx"]))
        out += [np.array([i, r, c]), *columns]
    for conv in sampled(net):
        dy, dx = douts[conv.name], douts[f"{conv.name}.dx"]
        i, r, c = position(dx, where)
        rows, cols = (at + conv.padding - np.arange(conv.kernel) for at in (r, c))  # r + p - a for each tap a
        s = conv.stride
        fit = [(t % s == 0) & (t >= 0) & (t // s < e) for t, e in zip((rows, cols), dy.shape[2:], strict=True)]
        window = np.zeros((dy.shape[1], conv.kernel, conv.kernel), np.float32)
        a, b = np.flatnonzero(fit[0])[:, None], np.flatnonzero(fit[1])
        window[:, a, b] = dy[i][:, rows[a] // s, cols[b] // s]
        out += [dx[i, :, r, c], window.ravel()]
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def lrn_column(
    lrn: LocalResponseNorm, x: np.ndarray, dy: np.ndarray, pair: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The LRN's dx at one position (``layers.LocalResponseNorm``), float64, from its input x (C,) and dy (C,) there,
    its terms' sizes (the same with every term's absolute value) and its output y there: with r = max(x, 0) and the
    ReLU's mask after it where ``pair`` (a ReLU before it: ``relu_lrn_backward``), else r = x,

        s = k + (alpha / n) sum_W r^2,    y = r s^-beta,
        dx = dy s^-beta - (2 alpha beta / n) r sum_W' dy r s^(-beta - 1)."""
    r = np.maximum(x, 0.0) if pair else x
    before, after = lrn.size // 2, (lrn.size - 1) // 2

    def window(a: np.ndarray, lo: int, hi: int) -> np.ndarray:  # sum over [i - lo, i + hi] of each i, clipped
        ends = np.concatenate([[0.0], np.cumsum(a)])
        i = np.arange(len(a))
        return ends[np.minimum(i + hi + 1, len(a))] - ends[np.maximum(i - lo, 0)]

    s = lrn.k + lrn.alpha / lrn.size * window(r * r, before, after)
    p, t, cross = s**-lrn.beta, dy * r * s ** (-lrn.beta - 1), 2 * lrn.alpha * lrn.beta / lrn.size
    dx, size = (
        dy * p - cross * r * window(t, after, before),
        np.abs(dy) * p + cross * np.abs(r) * window(np.abs(t), after, before),
    )
    return (dx * (r > 0), size * (r > 0), r * p) if pair else (dx, size, r * p)


def took(
    pool: MaxPool2D, features: np.ndarray, shape: tuple, at: tuple[int, int], y: np.ndarray, live: np.ndarray, n: int
) -> Pair:
    """The hybrid's last LRN's output y (C,) at ``at`` (row, column) of its map (``shape``: C, H, W), in the channels
    where its dy is not 0 (``live``): there the position won a window of the max pool after it, so that window's
    feature (in the worker's ``features`` of that image) is y itself. Of the windows that hold the position (4 at
    most for 3 x 3, stride 2), the feature nearest y, within y's round-off (k: s's ``n`` squares and scaling, its
    pow, the product)."""
    c, h, w = shape
    _, _, fh, fw = pool.output_shape((1, c, h, w))
    k, s, p = pool.kernel, pool.stride, pool.padding
    holds = [[o for o in range(m) if 0 <= a + p - o * s < k] for a, m in zip(at, (fh, fw), strict=True)]
    if not all(holds):  # no window reads the position (a pool that leaves an edge out): no dy reaches it
        return np.ones(1), np.zeros(1), 0.0
    near = features.reshape(c, fh, fw)[live][:, holds[0]][:, :, holds[1]].reshape(int(live.sum()), -1)
    near = np.take_along_axis(near, np.abs(near - y[live, None]).argmin(axis=1)[:, None], axis=1)[:, 0]
    return near, y[live], float32_tolerance(n + 3 + FN, np.abs(y[live]))


@functools.lru_cache(maxsize=64)
def _layout(net: Network, kind: str, x_shape: tuple[int, ...]) -> tuple[int, list, list, list, int]:
    """What ``check`` reads for a ``kind`` task of the replica ``net`` on slices of ``x_shape``, once (a replica's
    layers do not change; its conv part, the hybrid's, is a new Network each time): the parameters' length; each
    norm's name, C, M, eps, its bound's factor, its gamma and beta in the parameters and where its sums start in
    ``sums`` (its mean and variance in ``stats``: each norm's buffers); each LRN, its map's (C, H, W), whether a
    ReLU comes before it, the hybrid's max pool after it that makes the features (else None) and where its
    sample starts; each sampled convolution's name, its weights and their shape, and where its sample starts; the
    length of ``sums``."""
    part = net if kind == "replica_step" else conv_part(net)
    at, shape, start, norms, lrns, convs = flat.spans(part), x_shape, 0, [], [], []
    fused = {run[-1].name for run in part.runs() if len(run) == 2}  # an LRN after a ReLU: the pair's dx
    for layer in part.layers:
        if isinstance(layer, BatchNorm2D):
            c, m, name = layer.channels, shape[0] * shape[2] * shape[3], layer.name
            bound = probe.tolerance(2 * m + 32, 1)
            norms.append((name, c, m, layer.eps, bound, at[f"{name}.gamma"], at[f"{name}.beta"], start))
            start += 2 * c
        elif isinstance(layer, LocalResponseNorm):
            lrns.append((layer, shape[1:], layer.name in fused))
        shape = layer.output_shape(shape)
    last, pool = part.layers[-2:] if kind == "hybrid_forward" else (None, None)  # the features: a pool of its map?
    for i, (lrn, map_shape, pair) in enumerate(lrns):
        into = pool if lrn is last and isinstance(pool, MaxPool2D) else None
        lrns[i], start = (lrn, map_shape, pair, into, start), start + 3 + 3 * map_shape[0]
    for conv in sampled(part):
        f, c, kh, kw = conv.params["w"].shape
        convs.append((conv.name, at[f"{conv.name}.w"], (f, c, kh * kw), start))
        start += c + f * kh * kw
    return sum(flat.sizes(part)), norms, lrns, convs, start


def check(first: Message, answer: Message, reply: Message, net: Network) -> list[tuple[str, Pair]]:
    """Each batch norm, LRN and sampled dX of the replica ``net`` (of its conv part, the hybrid's) in a step whose
    task is ``first`` (its slice x, the params): the worker's sum dx dy in ``reply`` (``inner``, as ``sums`` lays it
    out) against g (e - dbeta^2 / M - dgamma^2 / M) from its e, the gradient it sent and the unbiased variance in
    ``answer`` (``stats``; the hybrid's forward's), an LRN's dx against its input and dy (and the hybrid's last
    LRN's output against its ``features``: ``took``), and its dX against W times its window. Within
    ``probe.tolerance`` on their terms: |g| (e + (dbeta^2 + dgamma^2) / M + 2 (|dbeta| + |dgamma|) sqrt(2 e / M)),
    k = 2 M + 32 (every rounding of dx, of dbeta and dgamma twice, of g), and |W| . |window|, k = F K K + K K + 2
    (any order of the GEMM and col2im); the LRN's within the rigorous bound, k = 2 n + 3 FN + 8 (s's sum and
    scaling, its pow, y, dy y / s, their window's sum, the rest)."""
    total, norms, lrns, convs, end = _layout(net, first.kind, first.arrays["x"].shape)
    grads, stats, got = reply.arrays.get("grads"), answer.arrays.get("stats"), reply.arrays.get("inner")
    if got is None or got.shape != (end,) or grads is None or grads.shape != (total,):
        return []  # not this file's to judge: no probe asked for them, or the split's shape check loses the worker
    out, params = [], first.arrays["params"]
    buffers = sum(2 * norm[1] for norm in norms)  # each norm's mean and variance, in ``stats``
    for name, c, m, eps, bound, gamma, beta, at in norms if stats is not None and stats.shape == (buffers,) else []:
        var = stats[at + c : at + 2 * c].astype(np.float64) * ((m - 1) / m)  # the biased variance
        g = params[gamma] / np.sqrt(np.maximum(var, 0.0) + eps)
        db, dg, e = (a.astype(np.float64) for a in (grads[beta], grads[gamma], got[at + c : at + 2 * c]))
        sides = (db * db + dg * dg) / m
        terms = np.abs(g) * (e + sides + 2 * (np.abs(db) + np.abs(dg)) * np.sqrt(2 * e / m))
        out.append(
            (f"{name}'s sum dx dy against its dbeta and dgamma", (got[at : at + c], g * (e - sides), bound * terms))
        )
    for lrn, (c, h, w), pair, pool, at in lrns:
        where, (x, dy, dx) = got[at : at + 3], got[at + 3 : at + 3 + 3 * c].reshape(3, c)
        i, r, col = (int(v) if np.isfinite(v) else -1 for v in where)
        if not (0 <= i < len(first.arrays["x"]) and 0 <= r < h and 0 <= col < w and (where == (i, r, col)).all()):
            out.append((f"{lrn.name}'s sampled position, which is off its map,", (np.ones(1), np.zeros(1), 0.0)))
            continue
        ref, size, y = lrn_column(lrn, x.astype(np.float64), dy.astype(np.float64), pair)
        k = 2 * lrn.size + 3 * FN + 8  # s's sum and scaling, its pow, y, dy y / s, their sum, the rest
        out.append((f"{lrn.name}'s dx at one position against its input and dy", (dx, ref, float32_tolerance(k, size))))
        if pool is not None and (live := dy != 0).any() and "features" in answer.arrays:
            what = f"{lrn.name}'s output at one position against the features its pool took"
            out.append((what, took(pool, answer.arrays["features"][i], (c, h, w), (r, col), y, live, lrn.size)))
    for name, span, (f, c, kk), at in convs:
        w, window = params[span].astype(np.float64).reshape(f, c, kk), got[at + c : at + c + f * kk].reshape(f, 1, kk)
        ref, size = (np.einsum("fck,fjk->c", a, b) for a, b in ((w, window), (np.abs(w), np.abs(window))))
        bound = probe.tolerance(f * kk + kk + 2, 1)
        out.append((f"{name}'s dX at one position against its window of dY", (got[at : at + c], ref, bound * size)))
    return out
