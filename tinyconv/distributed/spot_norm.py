"""Spot checks through a tail's batch norm (``shard/norm.py``): a kernel sample recomputes its kernel's batch
statistics and dgamma and dbeta; an image sample is normalised by the worker's (docs/how-it-works.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Backend
from backends.conformance.checks import float32_tolerance
from tinyconv.distributed.protocol import NORM_INPUTS
from tinyconv.distributed.shard.block import BlockCache, tail_backward, tail_forward
from tinyconv.distributed.spot_sample import Pair, Sample, pair


def batch_norm(tail: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A tail's batch norm spec, if it has one."""
    return next((spec for spec in tail if spec["op"] == "bn"), None)


def task_norm(be: Backend, arrays: dict[str, np.ndarray], kernels: slice) -> dict[str, Any]:
    """A task's batch-norm arrays (gamma, beta; running_mean, running_var outside training) over ``kernels``, on the
    backend: what a sample's tail normalises by (in training it puts its batch statistics in: block.tail_forward)."""
    return {k: be.asarray(np.ascontiguousarray(arrays[k][kernels])) for k in NORM_INPUTS if k in arrays}


@dataclass
class NormedImage:
    """An image sample's tail around a training batch norm, in three pieces: the layers before it, the norm, those
    after. The one image is normalised by the worker's batch statistics, as an evaluation is by running ones, and
    its backward adds what the batch's statistics give each image's gradient (``BatchNorm2D``'s math)::

        dz = gamma / std * (du - dbeta / M - xhat * dgamma / M),   dbeta and dgamma the worker's, over the batch
    """

    before: BlockCache  # the layers before the norm, on every computed kernel
    norm: Any  # the backend's cache of the norm, run as an evaluation
    after: BlockCache  # the layers after it, down to the sample's own kernels
    xhat: np.ndarray  # (1, F', OH, OW): the norm's input, normalised
    m: int  # the batch's values per kernel
    exact: bool  # no LRN before the norm: the halo's gradient, which its dgamma and dbeta do not cover, is not read

    @property
    def conv(self) -> Any:
        return self.before.conv


def image_forward(
    be: Backend, conv: Any, conv_cache: Any, tail: list, norm: dict, stats: dict, m: int, own: tuple[int, int]
) -> tuple[Any, BlockCache | NormedImage]:
    """An image sample's tail over its convolution ``conv`` (1, F', OH, OW): ``block.tail_forward``, but with a
    training batch norm, in pieces (:class:`NormedImage`) by the worker's ``stats``, its batch mean and unbiased
    variance of the same kernels (which the kernel samples check); ``norm`` gets ``var`` for :func:`norm_gain`."""
    bn = batch_norm(tail)
    if bn is None or not bn["training"]:
        return tail_forward(be, conv, conv_cache, tail, own, norm)
    i, f = tail.index(bn), conv.shape[1]
    norm["var"] = np.maximum(stats["var"], np.float32(0))  # a wrong worker's may be negative: its y disagrees anyway
    mean, var = stats["mean"], norm["var"] * np.float32((m - 1) / m)  # the biased variance, which normalises
    z, before = tail_forward(be, conv, conv_cache, tail[:i], (0, f))
    u, cache = be.batchnorm_forward(
        z, norm["gamma"], norm["beta"], be.asarray(mean), be.asarray(var), False, 1.0, bn["eps"]
    )
    y, after = tail_forward(be, u, None, tail[i + 1 :], own)
    xhat = (be.to_numpy(z) - mean[None, :, None, None]) / np.sqrt(var + np.float32(bn["eps"]))[None, :, None, None]
    return y, NormedImage(before, cache, after, xhat, m, all(spec["op"] != "lrn" for spec in tail[:i]))


def image_backward(be: Backend, dy: Any, cache: BlockCache | NormedImage, dnorm: dict[str, np.ndarray]) -> Any:
    """The conv-output gradient of an image sample's own kernels from dy over its computed ones (block.tail_backward),
    or through a :class:`NormedImage` with ``dnorm``, the worker's dgamma and dbeta of its computed kernels (0 on the
    halo, whose gradient is then 0); None where that is not exact."""
    if not isinstance(cache, NormedImage):
        return tail_backward(be, dy, cache)
    if not cache.exact:
        return None
    d = be.to_numpy(tail_backward(be, dy, cache.after))  # 0 beyond its own kernels
    d = (
        d
        - (dnorm["beta"] / cache.m)[None, :, None, None]
        - cache.xhat * (dnorm["gamma"] / cache.m)[None, :, None, None]
    )
    d, _, _ = be.batchnorm_backward(be.asarray(d.astype(np.float32)), cache.norm)
    return tail_backward(be, d, cache.before)


def spread(got: dict[str, np.ndarray], f: int, own: tuple[int, int]) -> dict[str, np.ndarray]:
    """A worker's dgamma and dbeta of its own kernels [lo, hi), as ``got`` holds them, on all ``f`` it computed
    (0 on the halo): what :func:`image_backward` takes."""
    out = {name: np.zeros(f, np.float32) for name in ("gamma", "beta")}
    for name, full in out.items():
        if "d" + name in got:
            full[own[0] : own[1]] = got["d" + name]
    return out


def norm_gain(be: Backend, tail: list[dict[str, Any]], norm: dict[str, Any], m: int) -> float:
    """max |gamma| / sqrt(var + eps) over a sample's kernels (1 without a batch norm): how much the batch norm scales
    the round-off of the convolution before it. var: the batch's, made biased again, in training; else the running."""
    bn = batch_norm(tail)
    if bn is None:
        return 1.0
    var = be.to_numpy(norm["var"]) * np.float32((m - 1) / m) if bn["training"] else be.to_numpy(norm["running_var"])
    return float(np.max(np.abs(be.to_numpy(norm["gamma"])) / np.sqrt(var + np.float32(bn["eps"])), initial=0.0))


def norm_forward_pairs(be: Backend, sample: Sample, got: dict[str, np.ndarray], k: int, m: int) -> list[Pair]:
    """A training kernel sample's batch mean and variance against the worker's, ``got`` (1,) each: k of the
    convolution + the m values each sums, on the convolution's scale (squared, for the variance)."""
    c = sample.at - sample.span.start  # the kernel, among the sample's
    ref = {name: be.to_numpy(sample.norm[name])[c : c + 1] for name in ("mean", "var")}
    return [
        pair(got["mean"], ref["mean"], k + m + 1, sample.top),
        pair(got["var"], ref["var"], k + m + 4, sample.top**2),
    ]


def norm_backward_pairs(
    be: Backend, sample: Sample, bn: dict[str, Any], got: dict[str, np.ndarray], dy: np.ndarray, k: int, m: int
) -> list[Pair]:
    """A kernel sample's dgamma and dbeta against the worker's, ``got`` (1,) each, in the rigorous form over bounds of
    their m terms, from dy (N, 1, OH', OW'), the kernel's output gradient: |dbeta's terms| sum to at most sum |dy|
    (max pool routes each dy to one input, ReLU masks), dgamma's to that times max |xhat| <= 2 max|conv| / std."""
    var = float(be.to_numpy(sample.norm["var"])[sample.at - sample.span.start])
    std = np.sqrt(var * ((m - 1) / m if bn["training"] else 1) + bn["eps"])
    terms = float(np.abs(dy).sum(dtype=np.float64))
    ref = {name: be.to_numpy(v) for name, v in sample.cache.dnorm.items()}
    tol = {"beta": terms, "gamma": terms * 2 * sample.top / std}
    return [(got["d" + name], ref[name], float(float32_tolerance(min(k, 2**22), tol[name]))) for name in tol]
