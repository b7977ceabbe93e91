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
grows as L, the bound as sqrt(L): the master checks the last 2 to WINDOW steps too (:class:`Trails`).

The master sends u and v with the task (``probe``), the worker returns s and a for each convolution, and each
image's sum of dY squared (``probes``; ``image_backward.py``) beside its gradient, and the master compares s
with u^T dW v of the dW it got. A dW changed after the sums (a faulty GEMM, 1 % on every entry) shows unless
u^T dW v is small against a: so u, v are the top singular pair of that worker's last dW (:func:`top_pair`),
along which the sum does not cancel. The model split's tasks carry one too, of the one convolution they are
(``spot_check.SpotCheck.ask``): the worker returns s and a from the conv-output gradient of its kernels and the
input it holds (:func:`sums`), by kernels, or summed over the chunks, by input channels.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from tinyconv.distributed.spot_sample import Pair
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
    u, v (:func:`sums`); e_i = sum dY[i]^2, image i's (``image_backward.py``)."""
    out = []
    for c, (u, v) in zip(convs(net), pairs(net, probe), strict=True):
        x, dy = inputs[c.name], douts[c.name]
        out += [*sums(x, dy, u, v, c.stride, c.padding), *np.square(dy, dtype=np.float64).sum(axis=(1, 2, 3))]
    return np.array(out, np.float32)


def sums(x: np.ndarray, dy: np.ndarray, u: np.ndarray, v: np.ndarray, stride: int, padding: int) -> tuple[float, float]:
    """s and a (the module's docstring) of a convolution's dW = dY cols^T, from its input x (n, C, H, W) and output
    gradient dY (n, F, OH, OW), u (F,) and v (C, K, K). In float32, with BLAS: s adds F + C K K roundings of its own
    to dW's n OH OW (:func:`roundings`)."""
    d = dy.reshape(dy.shape[0], dy.shape[1], -1)  # (n, F, OH OW)
    conv, terms = one_kernel(x, v, stride, padding, also_abs=True).reshape(2, len(x), -1)
    s = (u @ d) * conv
    a = (np.abs(u) @ np.abs(d)) * terms
    return float(s.sum(dtype=np.float64)), float(a.sum(dtype=np.float64))


def one_kernel(x: np.ndarray, v: np.ndarray, stride: int, padding: int, also_abs: bool = False) -> np.ndarray:
    """x (n, C, H, W) convolved with the one kernel v (C, K, K), no bias -> (n, OH, OW): the channels contracted
    first, one GEMM (K K, C) x (C, n HP WP), then the K K shifted planes added. ``also_abs``: |x| with |v| too,
    stacked after it -> (2, n, OH, OW) (an optimisation: one padding and one pass of the shifts for both)."""
    n, c, h, w = x.shape
    k = v.shape[-1]
    xp = np.pad(x.transpose(1, 0, 2, 3), ((0, 0), (0, 0), (padding, padding), (padding, padding))).reshape(c, -1)
    z = np.empty((1 + also_abs, k * k, n, h + 2 * padding, w + 2 * padding), np.float32)
    np.matmul(v.reshape(c, k * k).T, xp, out=z[0].reshape(k * k, -1))
    if also_abs:
        np.matmul(np.abs(v).reshape(c, k * k).T, np.abs(xp), out=z[1].reshape(k * k, -1))
    oh, ow = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1
    out = np.zeros((len(z), n, oh, ow), np.float32)
    for i in range(k):
        for j in range(k):
            out += z[:, i * k + j, :, i : i + stride * oh : stride, j : j + stride * ow : stride]
    return out if also_abs else out[0]


def roundings(net: Network, x_shape: tuple[int, ...]) -> list[int]:
    """k of each convolution's check on x (n, C, H, W) (:func:`length`)."""
    out, shape = [], x_shape
    for layer in net.layers:
        shape = layer.output_shape(shape)
        if isinstance(layer, Conv2D):
            out.append(length(shape[0] * shape[2] * shape[3], layer.out_channels, layer.in_channels * layer.kernel**2))
    return out


def length(terms: int, f: int, ckk: int) -> int:
    """k of one check of a dW (f, ckk) summed over ``terms`` products (n OH OW): dW's sums; s's F + C K K + 1, and
    as many for the master's u^T dW v in float32 (its products' terms are a's too, so a bounds their round-off)."""
    return terms + 2 * (f + ckk + 1)


def compared(dw: np.ndarray, u: np.ndarray, v: np.ndarray, s: float, a: float, k: int) -> tuple[Pair, tuple]:
    """The worker's s against u^T dW v of the dW (F, C K K) it sent, within :func:`tolerance` (s rounded to float32
    once more), and the row :class:`Trails` keeps of it: (s, u^T dW v, k, a)."""
    ref = float(u @ (dw @ v.ravel()))
    return (np.array([s]), np.array([ref]), tolerance(k, a) + 2**-23 * abs(s)), (s, ref, k, a)


class Trails:
    """Each check's last rows (the worker's number s, the master's, k, a; one per convolution), by key (a worker and
    a check), and their disagreements summed over the last 2 to ``WINDOW`` of them, each sum held to the module's
    windowed bound and s rounded to float32 once each step: a fault that keeps its sign grows as the checks, their
    bound as its root. (In Python floats, each row kept as the terms its sums add, s, u^T dW v, k a^2, k^2 a and |s|:
    at most ``WINDOW`` rows, where numpy's calls cost more than the sums.)"""

    def __init__(self) -> None:
        self.kept: dict[tuple, collections.deque] = {}

    def __call__(self, key: tuple, names: list[str], rows: list[tuple]) -> list[tuple[str, Pair]]:
        """Keep ``rows`` under ``key``; the sums' checks, named after ``names`` (one per row), of those with a sum
        beyond its bound (none: all within)."""
        trail = self.kept.setdefault(key, collections.deque(maxlen=WINDOW))
        if trail and len(trail[-1]) != len(rows):  # another network: its sums start again
            trail.clear()
        trail.append(
            [(float(s), float(ref), k * float(a) ** 2, k * k * float(a), abs(float(s))) for s, ref, k, a in rows]
        )
        out = []
        for i, what in enumerate(names if len(trail) > 1 else []):
            sums, got, want, ka2, k2a, size = [], 0.0, 0.0, 0.0, 0.0, 0.0  # over the newest 1, 2, ... rows
            for row in reversed(trail):
                s, ref, k_a2, k2_a, abs_s = row[i]
                got, want, ka2, k2a, size = got + s, want + ref, ka2 + k_a2, k2a + k2_a, size + abs_s
                sums.append((got, want, 2 * (LAMBDA * U * math.sqrt(ka2) + U * U * k2a) + 2**-23 * size))
            if all(abs(got - ref) <= tol for got, ref, tol in sums[1:]):  # an optimisation: most steps, no arrays
                continue
            got, ref, tol = (np.array(column) for column in zip(*sums[1:], strict=True))
            out.append((f"{what}, summed over its last 2 to {len(trail)} checks", (got, ref, tol)))
        return out

    def forget(self, worker: int) -> None:
        """Drop a lost worker's trails (keys that start with it)."""
        for key in [key for key in self.kept if key[0] == worker]:
            del self.kept[key]


def top_pair(
    dw: np.ndarray, start: tuple[np.ndarray, np.ndarray] | None, steps: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """Near the top singular pair (u, v) of dW (F, C K K), float32: ``steps`` power iterations from ``start``
    (the last step's pair: gradients turn slowly, so each step's two refine it further) or from all ones."""
    u = start[0] if start is not None else np.ones(dw.shape[0], np.float32)
    for _ in range(steps):
        v = dw.T @ u
        v /= math.sqrt(float(v @ v)) or 1.0
        u = dw @ v
        u /= math.sqrt(float(u @ u)) or 1.0
    return u, v
