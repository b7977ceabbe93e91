"""A cheap exact check of a slice's convolution gradients: Freivalds' trick on dW's GEMM.

A convolution's weight gradient is a sum over every image n and output position p of an outer product
(``Conv2D``: dW = dY cols^T, cols the im2col of its input). For vectors u (F) and v (C K K),

    u^T dW v = sum_{n, p} (u . dY[n, :, p]) (v . cols[n, :, p])

and the right side is a weighted sum of dY's channels and a one-kernel convolution of the input: 1/(C K K)
and 1/F of the GEMM. Its terms' sizes, a = sum_{n, p} (|u| . |dY[n, :, p]|) (|v| . |cols[n, :, p]|), bound
the round-off of any order of summing them: gamma_k a at worst, k = n OH OW + 2 (F + C K K + 1) (every sum
in float32). That worst case, every rounding error of one sign, is 20-50 times a 1 % change of u^T dW v
along dW's top singular pair; so this check, alone in the project, takes Higham and Mary's probabilistic
bound (SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4): with rounding errors independent and of mean zero,

    |u^T dW v - s| <= 2 (exp(lambda sqrt(k) u + k u^2 / (1 - u)) - 1) a

fails with probability at most 2 k exp(-lambda^2 (1 - u)^2 / 2) per computation: below 1e-10 at LAMBDA = 8
and k <= 10^5. Its margin, measured between OpenCL workers and a numpy master, is the rigorous bound's
hundredfold (docs/how-it-works.md, "Spot checks").

A dW a little off on every step (1 % of a gradient whose u^T dW v is 1-6 % of a: conv1's) can hide under each
step's bound and not under the sum of a few. The first-order part of the round-off of all the sums in a window
of steps, sum_j delta_j c_j over every rounding j (|c_j| <= a of its step, sum_j |c_j| <= k a), is one
martingale in the independent deltas, so by Azuma's inequality the disagreements of L steps add in quadrature:

    |sum_t (u_t^T dW_t v_t - s_t)| <= 2 (lambda u sqrt(sum_t k_t a_t^2) + u^2 sum_t k_t^2 a_t)

(the second term the rest of each product of (1 + delta)s, at most k^2 u^2 of its term), failing with
probability 2 exp(-lambda^2 / 2) per window. A fault that keeps its sign (u, v turn with dW: u^T dW v > 0)
grows as L, the bound as sqrt(L): the master checks the last 2 to WINDOW steps too (:func:`window_tolerance`).

The master sends u and v with the task (``probe``), the worker returns s and a for each convolution, and each
image's sum of dY squared (``probes``; ``image_backward.py``) beside its gradient, and the master compares s
with u^T dW v of the dW it got. A dW changed after the sums (a faulty GEMM, 1 % on every entry) shows unless
u^T dW v is small against a: so u, v are the top singular pair of that worker's last dW (:func:`top_pair`),
along which the sum does not cancel.
"""

from __future__ import annotations

import math

import numpy as np

from tinyconv.layers import Conv2D
from tinyconv.model import Network

LAMBDA = 8.0  # the probabilistic bound's lambda (the module's docstring)
U = 2.0**-24  # float32's unit round-off
WHERE = 3  # a probe's last numbers: where dX is sampled (inner_ops.py), its image, row and column as fractions
WINDOW = 8  # steps whose disagreements are also judged summed: the last 2, 3, ..., WINDOW


def tolerance(k: int, a: float) -> float:
    """How far apart an honest worker's s and the master's u^T dW v may be: the module's bound, for each of the two
    computations."""
    return 2 * math.expm1(LAMBDA * math.sqrt(k) * U + k * U * U / (1 - U)) * a


def window_tolerance(rows: np.ndarray) -> np.ndarray:
    """How far the sums over the last 1, 2, ..., L steps of an honest worker's s and the master's u^T dW v may be
    apart, ``rows`` (L, ..., 4) each step's (s, u^T dW v, k, a), oldest first: the module's bound over each of
    those windows, and s rounded to float32 once each step. Shape (L, ...)."""
    s, _, k, a = np.moveaxis(np.asarray(rows, np.float64)[::-1], -1, 0)
    first, second = LAMBDA * U * np.sqrt(np.cumsum(k * a * a, axis=0)), U * U * np.cumsum(k * k * a, axis=0)
    return 2 * (first + second) + 2**-23 * np.cumsum(np.abs(s), axis=0)


def convs(net: Network) -> list[Conv2D]:
    """The network's convolutions, in order: one (u, v) pair each."""
    return [layer for layer in net.layers if isinstance(layer, Conv2D)]


def size(net: Network) -> int:
    """The floats of a probe: F + C K K for each convolution, then ``WHERE`` (``inner_ops.py``)."""
    return sum(c.out_channels + c.in_channels * c.kernel**2 for c in convs(net)) + WHERE


def pairs(net: Network, probe: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``probe`` cut into (u (F,), v (C, K, K)) per convolution, float32."""
    out, start = [], 0
    for c in convs(net):
        f, ckk = c.out_channels, c.in_channels * c.kernel**2
        u, v = probe[start : start + f], probe[start + f : start + f + ckk]
        out.append((u.astype(np.float32), v.astype(np.float32).reshape(c.in_channels, c.kernel, c.kernel)))
        start += f + ckk
    return out


def project(net: Network, probe: np.ndarray, inputs: dict[str, np.ndarray], douts: dict[str, np.ndarray]) -> np.ndarray:
    """(s, a, e_1, ..., e_n) of each convolution (L (2 + n),), from the input x (n, C, H, W) it saw and the
    gradient dY (n, F, OH, OW) its output got (``Network.forward`` and ``backward``'s ``seen``), and the probe's
    u, v; e_i = sum dY[i]^2, image i's (``image_backward.py``). In float32, with BLAS: s adds F + C K K
    roundings of its own to dW's n OH OW (:func:`roundings`)."""
    out = []
    for c, (u, v) in zip(convs(net), pairs(net, probe), strict=True):
        x, dy = inputs[c.name], douts[c.name]
        d = dy.reshape(dy.shape[0], dy.shape[1], -1)  # (n, F, OH OW)
        s = (u @ d) * one_kernel(x, v, c.stride, c.padding).reshape(len(x), -1)
        a = (np.abs(u) @ np.abs(d)) * one_kernel(np.abs(x), np.abs(v), c.stride, c.padding).reshape(len(x), -1)
        out += [s.sum(dtype=np.float64), a.sum(dtype=np.float64), *np.square(d, dtype=np.float64).sum(axis=(1, 2))]
    return np.array(out, np.float32)


def one_kernel(x: np.ndarray, v: np.ndarray, stride: int, padding: int) -> np.ndarray:
    """x (n, C, H, W) convolved with the one kernel v (C, K, K), no bias -> (n, OH, OW): the channels contracted
    first, one GEMM (K K, C) x (C, n HP WP), then the K K shifted planes added."""
    n, c, h, w = x.shape
    k = v.shape[-1]
    xp = np.pad(x.transpose(1, 0, 2, 3), ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    z = (v.reshape(c, k * k).T @ xp.reshape(c, -1)).reshape(k * k, n, h + 2 * padding, w + 2 * padding)
    oh, ow = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1
    out = np.zeros((n, oh, ow), np.float32)
    for i in range(k):
        for j in range(k):
            out += z[i * k + j, :, i : i + stride * oh : stride, j : j + stride * ow : stride]
    return out


def roundings(net: Network, x_shape: tuple[int, ...]) -> list[int]:
    """k of each convolution's check on x (n, C, H, W): dW's sums of n OH OW products; s's F + C K K + 1, and as
    many for the master's u^T dW v in float32 (its products' terms are a's too, so a bounds their round-off)."""
    out, shape = [], x_shape
    for layer in net.layers:
        shape = layer.output_shape(shape)
        if isinstance(layer, Conv2D):
            out.append(
                shape[0] * shape[2] * shape[3] + 2 * (layer.out_channels + layer.in_channels * layer.kernel**2 + 1)
            )
    return out


def top_pair(
    dw: np.ndarray, start: tuple[np.ndarray, np.ndarray] | None, steps: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """Near the top singular pair (u, v) of dW (F, C K K), float32: ``steps`` power iterations from ``start``
    (the last step's pair: gradients turn slowly, so each step's two refine it further) or from all ones."""
    u = start[0] if start is not None else np.ones(dw.shape[0], np.float32)
    for _ in range(steps):
        v = dw.T @ u
        v /= np.linalg.norm(v) or 1.0
        u = dw @ v
        u /= np.linalg.norm(u) or 1.0
    return u, v
