"""The worker's backward checked inside, op by op: a wrong batch norm dx or convolution dX, which every sum the
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

Both are held to the projections' probabilistic bound (``probe.tolerance``); their k and terms, and what they
catch: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import functools

import numpy as np

from tinyconv.distributed.replica import flat, probe
from tinyconv.distributed.replica.conv_part import conv_part
from tinyconv.distributed.spot_sample import Pair
from tinyconv.layers import BatchNorm2D, Conv2D
from tinyconv.model import Network
from transports.base import Message


def sampled(net: Network) -> list[Conv2D]:
    """The network's convolutions that compute dX, in order: C + F K K numbers each."""
    return [layer for layer in probe.convs(net) if layer.need_dx]


def sums(net: Network, where: np.ndarray, douts: dict[str, np.ndarray]) -> np.ndarray:
    """The worker's: (sum dx dy, e) per channel of each batch norm, (2 C,) each, then each dX-computing
    convolution's dX at the position ``where`` (the probe's last ``probe.WHERE`` numbers) and its window of dY,
    (C + F K K,), float32; from the gradient each layer got and gave (``Network.backward``'s ``seen``: 'bn1' and
    'bn1.dx'), each sum one BLAS dot a row."""
    out = []
    for norm in (layer for layer in net.layers if isinstance(layer, BatchNorm2D)):
        dy, dx = douts[norm.name], douts[f"{norm.name}.dx"]
        n, c = dy.shape[:2]
        out += [(a.reshape(n, c, 1, -1) @ dy.reshape(n, c, -1, 1)).sum(axis=(0, 2, 3)) for a in (dx, dy)]
    for conv in sampled(net):
        dy, dx = douts[conv.name], douts[f"{conv.name}.dx"]
        extents = np.take(dx.shape, [0, 2, 3])
        i, r, c = (int(np.nan_to_num(abs(f)) * e) % e for f, e in zip(where, extents, strict=True))  # fractions
        live = np.flatnonzero(np.any(dx[i] != 0, axis=0))  # from there, the first position where dX is not all 0
        if live.size:  # (a sparse dY, after a max pool and ReLU, leaves whole windows empty: nothing to see there)
            r, c = divmod(int(live[np.searchsorted(live, r * dx.shape[3] + c) % live.size]), dx.shape[3])
        rows, cols = (at + conv.padding - np.arange(conv.kernel) for at in (r, c))  # r + p - a for each tap a
        s = conv.stride
        fit = [(t % s == 0) & (t >= 0) & (t // s < e) for t, e in zip((rows, cols), dy.shape[2:], strict=True)]
        window = np.zeros((dy.shape[1], conv.kernel, conv.kernel), np.float32)
        a, b = np.flatnonzero(fit[0])[:, None], np.flatnonzero(fit[1])
        window[:, a, b] = dy[i][:, rows[a] // s, cols[b] // s]
        out += [dx[i, :, r, c], window.ravel()]
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


@functools.lru_cache(maxsize=64)
def _layout(net: Network, kind: str, x_shape: tuple[int, ...]) -> tuple[int, list[tuple], list[tuple], int]:
    """What ``check`` reads for a ``kind`` task of the replica ``net`` on slices of ``x_shape``, once (a replica's
    layers do not change; its conv part, the hybrid's, is a new Network each time): the parameters' length; each
    norm's name, C, M, eps, its bound's factor, its gamma and beta in the parameters and where its sums start in
    ``sums`` (its mean and variance in ``stats``: each norm's buffers); each sampled convolution's name, its
    weights and their shape, and where its sample starts; the length of ``sums``."""
    part = net if kind == "replica_step" else conv_part(net)
    at, shape, start, norms, convs = flat.spans(part), x_shape, 0, [], []
    for layer in part.layers:
        if isinstance(layer, BatchNorm2D):
            c, m, name = layer.channels, shape[0] * shape[2] * shape[3], layer.name
            bound = probe.tolerance(2 * m + 32, 1)
            norms.append((name, c, m, layer.eps, bound, at[f"{name}.gamma"], at[f"{name}.beta"], start))
            start += 2 * c
        shape = layer.output_shape(shape)
    for conv in sampled(part):
        f, c, kh, kw = conv.params["w"].shape
        convs.append((conv.name, at[f"{conv.name}.w"], (f, c, kh * kw), start))
        start += c + f * kh * kw
    return sum(flat.sizes(part)), norms, convs, start


def check(first: Message, answer: Message, reply: Message, net: Network) -> list[tuple[str, Pair]]:
    """Each batch norm and sampled dX of the replica ``net`` (of its conv part, the hybrid's) in a step whose task is
    ``first`` (its slice x, the params): the worker's sum dx dy in ``reply`` (``inner``, as ``sums`` lays it out)
    against g (e - dbeta^2 / M - dgamma^2 / M) from its e, the gradient it sent and the unbiased variance in
    ``answer`` (``stats``; the hybrid's forward's), and its dX against W times its window. Each within
    ``probe.tolerance`` on its terms: |g| (e + (dbeta^2 + dgamma^2) / M + 2 (|dbeta| + |dgamma|) sqrt(2 e / M)),
    k = 2 M + 32 (every rounding of dx, of dbeta and dgamma twice, of g), and |W| . |window|, k = F K K + K K + 2
    (any order of the GEMM and col2im)."""
    total, norms, convs, end = _layout(net, first.kind, first.arrays["x"].shape)
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
    for name, span, (f, c, kk), at in convs:
        w, window = params[span].astype(np.float64).reshape(f, c, kk), got[at + c : at + c + f * kk].reshape(f, 1, kk)
        ref, size = (np.einsum("fck,fjk->c", a, b) for a, b in ((w, window), (np.abs(w), np.abs(window))))
        bound = probe.tolerance(f * kk + kk + 2, 1)
        out.append((f"{name}'s dX at one position against its window of dY", (got[at : at + c], ref, bound * size)))
    return out
