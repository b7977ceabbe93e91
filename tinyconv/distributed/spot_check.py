"""Spot checks: the master recomputes a sample of every worker's results and loses a worker whose numbers are wrong.

It samples the paper's split, by kernels (``by_kernels.py``); the tasks of the split by input channels
go unsampled.

A worker's answer to a ``block_forward`` (y) or a ``block_backward`` (dx, dw, db) is a fixed function
of the arrays the master sent it (``block.py``), so the master can recompute any part of it. Two
kinds of sample, each a small slice of the task (F' kernels computed, N images, E the halo)::

    image n     y[n], dx[n]           from x[n], w, b, dy[n]                    1/N of the task
    kernel j    y[:, j], dw[j], db[j] from x, w and b of [j - E, j + E], dy there   (2E + 1)/F' of it

The budget is kept in the master's own seconds. Each forward task earns its worker ``budget`` times
what the task would cost the master -- its kernel-images (F' N forward, twice that backward) at the
master's seconds per kernel-image, measured on its own share of the step when it has one
(``master_rate``, the cluster's to set), else on its image samples -- two thirds for image samples, a
third for kernel samples (``SHARES``); a sample is taken while its kind's credit is not negative, and
its seconds are taken off. Credit starts at zero, so a worker's first step is sampled (one wrong from
the start is caught at once), and a worker cannot buy itself fewer samples by answering fast or
claiming a short compute time.

A sample agrees when each entry is within float32 round-off of the master's, 2 gamma_k max|ref|
(``backends/conformance/checks.py``'s scale form), k the roundings on the longest path to it. The
forward is continuous in its inputs, so one forward disagreement loses the worker. The backward
passes through choices round-off can flip where two values tie (max pool's argmax, ReLU's sign: about
one backward sample in a few hundred between numpy and OpenCL), so a backward disagreement loses the
worker only if two more samples (other images or kernels) disagree too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import Backend, conv_output_size
from backends.conformance.checks import FN, float32_tolerance, scale
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.shard.block import BlockCache, block_backward, block_forward, halo_width
from transports.base import Message

# of the budget: image samples, cheap (1/N of a task), check the forward and dx; kernel samples, dw and db
SHARES = {"image": 2 / 3, "kernel": 1 / 3}


def tolerance(ref: np.ndarray, k: int) -> float:
    """How far another float32 computation of ``ref`` may be off, entry by entry: 2 gamma_k max|ref|
    (k past 2^22 is held there: gamma is then a third, a bound no wrong answer hides under anyway)."""
    return float(float32_tolerance(min(k, 2**22), scale(ref)))


def tail_roundings(tail: list[dict[str, Any]]) -> int:
    """The roundings a tail adds to a path, forward or backward: LRN sums ``size`` squares and takes a pow."""
    return sum(spec["size"] + 2 + FN for spec in tail if spec["op"] == "lrn")


def forward_roundings(task: Message) -> int:
    """k of a block's output: the convolution's C K K products and its bias, then the tail."""
    _, c, kh, kw = task.arrays["w"].shape
    return c * kh * kw + 1 + tail_roundings(task.header["tail"])


@dataclass
class _Sample:
    """One sample of a worker's forward: where, and the master's own numbers, kept for the backward."""

    kind: str  # "image" or "kernel"
    at: int  # the image n, or the kernel j (of the F' computed)
    span: slice  # the kernels the master computed for it
    y: np.ndarray  # the master's output: y[n] (1, own, OH', OW') or y[:, j] (N, 1, OH', OW')
    cache: BlockCache

    def got(self, a: np.ndarray, lo: int) -> np.ndarray:
        """The worker's entries of a result array ``a`` (images first, then its own kernels from ``lo``) it covers."""
        return a[self.at : self.at + 1] if self.kind == "image" else a[:, self.at - lo : self.at - lo + 1]


@dataclass
class _Worker:
    credit: dict[str, float] = field(default_factory=lambda: {"image": 0.0, "kernel": 0.0})  # master seconds
    forward: Message | None = None  # its last block_forward, whose backward the samples check
    samples: list[_Sample] = field(default_factory=list)


Pair = tuple[np.ndarray, np.ndarray, int]  # (the worker's entries, the master's, their k)


class SpotCheck:
    """Samples every worker's block results within ``budget`` of its work; raises Lost on a wrong one.

    What it did: ``samples`` taken, ``seconds`` the master spent on them, ``earned`` the seconds the
    budget allowed, and ``forgiven`` backward disagreements another sample did not confirm."""

    def __init__(self, budget: float = 0.03, seed: int = 0) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"the spot-check budget is a fraction of each worker's work in (0, 1], got {budget!r}")
        self.budget = budget
        self.rng = np.random.default_rng(seed)
        self.workers: dict[int, _Worker] = {}
        self.samples = self.forgiven = 0
        self.seconds = self.earned = 0.0
        self._image: dict[int, list[float]] = {}  # layer -> its image samples' seconds and kernel-images
        self.master_rate: dict[int, float] = {}  # layer -> the master's seconds per kernel-image on its own share

    def __call__(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        """Check worker ``k``'s ``reply`` (float32, well formed) to ``task`` on the master's backend ``be``."""
        if task.kind == "block_forward":
            self._forward(k, task, reply, be)
        elif task.kind == "block_backward":
            self._backward(k, task, reply, be)

    def _spend(self, state: _Worker, sample: _Sample, t0: float, cells: int, layer: int) -> None:
        """Take a sample's seconds since ``t0`` off its kind's credit (``cells``: its kernel-images, for the rate)."""
        dt = time.perf_counter() - t0
        state.credit[sample.kind] -= dt
        self.seconds += dt
        if sample.kind == "image":
            spent = self._image.setdefault(layer, [0.0, 0.0])
            spent[0] += dt
            spent[1] += cells

    def _forward(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        n, f = task.arrays["x"].shape[0], task.arrays["w"].shape[0]
        lo, hi = task.header["own"]
        if reply.arrays["y"].shape[:2] != (n, hi - lo):
            return  # not this file's to judge: the split's shape check loses the worker
        state = self.workers.setdefault(k, _Worker())
        state.forward, state.samples = task, []
        layer, (spent, cells) = task.header["layer"], self._image.get(task.header["layer"], (0.0, 0.0))
        rate = self.master_rate.get(layer) or (spent / cells if cells else 0.0)  # master seconds per kernel-image
        for kind, share in SHARES.items():
            earned = self.budget * share * 3 * f * n * rate
            state.credit[kind] += earned
            self.earned += earned
            if state.credit[kind] < 0:
                continue
            t0 = time.perf_counter()
            sample = self._sample(kind, task, be)
            if sample is None:
                continue
            self.samples += 1
            got = sample.got(reply.arrays["y"], lo)
            self._spend(state, sample, t0, f, layer)
            self._judge(k, f"its forward, in {sample.kind} {sample.at}", [(got, sample.y, forward_roundings(task))])
            state.samples.append(sample)

    def _backward(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        state = self.workers.get(k)
        fwd = state.forward if state else None
        if fwd is None or (fwd.header["step"], fwd.header["layer"]) != (task.header["step"], task.header["layer"]):
            return
        for sample in state.samples:
            t0 = time.perf_counter()
            pairs = self._backward_pairs(sample, fwd, task, reply, be)
            agree, seen = _agree(pairs), [sample.at]
            while not agree and len(seen) < 3 and (again := self._sample(sample.kind, fwd, be, seen)) is not None:
                agree = _agree(self._backward_pairs(again, fwd, task, reply, be))
                self.forgiven += agree  # round-off flipped a tie in the first sample, not a wrong worker
                seen.append(again.at)
            self._spend(state, sample, t0, 2 * fwd.arrays["w"].shape[0], fwd.header["layer"])
            if not agree:
                self._judge(k, f"its backward, in {sample.kind} {sample.at}", pairs)

    def _sample(self, kind: str, task: Message, be: Backend, besides: Sequence[int] = ()) -> _Sample | None:
        """A new sample of a forward task (not at ``besides``), the master's forward of it computed; None if none."""
        x, w, b, h = task.arrays["x"], task.arrays["w"], task.arrays["b"], task.header
        lo, hi = h["own"]
        choices = [i for i in (range(x.shape[0]) if kind == "image" else range(lo, hi)) if i not in besides]
        if not choices:
            return None
        at = int(self.rng.choice(choices))
        if kind == "image":
            span, xs, own = slice(0, w.shape[0]), x[at : at + 1], (lo, hi)
        else:  # the kernel and its halo, clipped where the task's kernels end: there its halo hit the true edge
            e = halo_width(h["tail"])
            span = slice(max(0, at - e), min(w.shape[0], at + e + 1))
            xs, own = x, (at - span.start, at - span.start + 1)
        y, cache = block_forward(
            be, be.asarray(xs), be.asarray(w[span]), be.asarray(b[span]), h["stride"], h["padding"], h["tail"], own
        )
        return _Sample(kind, at, span, np.asarray(be.to_numpy(y)), cache)

    def _backward_pairs(self, sample: _Sample, fwd: Message, task: Message, reply: Message, be: Backend) -> list[Pair]:
        """The worker's and the master's backward for a sample: dx of its image, or dw and db of its kernel."""
        dy, lo = task.arrays["dy"], fwd.header["own"][0]
        f, _, kh, kw = fwd.arrays["w"].shape
        k = forward_roundings(fwd) + tail_roundings(fwd.header["tail"])
        if sample.kind == "image":
            if not (task.header["need_dx"] and "dx" in reply.arrays):
                return []
            dx, _, _ = block_backward(be, be.asarray(dy[sample.at : sample.at + 1]), sample.cache, True)
            return [(sample.got(reply.arrays["dx"], lo), np.asarray(be.to_numpy(dx)), k + f * kh * kw)]
        _, dw, db = block_backward(be, be.asarray(dy[:, sample.span]), sample.cache, need_dx=False)
        positions = dy.shape[0] * int(np.prod(_conv_hw(fwd)))  # dw and db sum over every conv output
        j = sample.at - lo
        return [
            (reply.arrays["dw"][j : j + 1], np.asarray(be.to_numpy(dw)), k + positions),
            (reply.arrays["db"][j : j + 1], np.asarray(be.to_numpy(db)), k + positions),
        ]

    def _judge(self, k: int, where: str, pairs: list[Pair]) -> None:
        for got, ref, rounds in pairs:
            err, tol = float(np.max(np.abs(got - ref), initial=0.0)), tolerance(ref, rounds)
            if not err <= tol:
                self.workers.pop(k, None)
                why = f"wrong result: {where} differs from the master's by {err:.3g} (round-off allows {tol:.3g})"
                raise Lost({k: why}, wrong=True)


def _agree(pairs: list[Pair]) -> bool:
    return all(np.all(np.abs(got - ref) <= tolerance(ref, k)) for got, ref, k in pairs)


def _conv_hw(task: Message) -> tuple[int, int]:
    """(OH, OW) of a block_forward task's convolution, before its tail."""
    _, _, h, w = task.arrays["x"].shape
    k, s, p = task.arrays["w"].shape[2], task.header["stride"], task.header["padding"]
    return conv_output_size(h, k, s, p), conv_output_size(w, k, s, p)
