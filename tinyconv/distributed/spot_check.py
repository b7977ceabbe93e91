"""Spot checks: the master recomputes a sample of every worker's results and loses a worker whose numbers are wrong.

Each split is sampled through a *view* of one worker's tasks of one layer's step: by kernels (:class:`ByKernels`)
and by input channels (``spot_check_channels.py``). The samples, the budget and the round-off each is held to:
docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import Backend, conv_output_size
from backends.conformance.checks import scale
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.shard.block import tail_backward, tail_forward, tail_output_hw
from tinyconv.distributed.spot_check_channels import ByChannels
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

# of the budget: image samples, cheap (1/N of a task), check the forward and dx; kernel samples, dw and db
SHARES = {"image": 2 / 3, "kernel": 1 / 3}

# the tasks it samples: by kernels (block.py), by input channels (by_channels.py)
TASKS = ("block_forward", "block_backward", "partial_forward", "tail_forward", "tail_backward", "partial_backward")


class ByKernels:
    """A worker's block_forward and block_backward (``block.py``) of one layer's step: a view of it, as
    ``spot_check_channels.ByChannels`` is of the other split. ``work``: its forward's kernel-channel-images."""

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


@dataclass
class _Worker:
    credit: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> kind -> master seconds
    views: dict[int, Any] = field(default_factory=dict)  # layer -> a view of its tasks of the step under way
    samples: dict[int, list[Sample]] = field(default_factory=dict)  # layer -> that forward's, for its backward


class SpotCheck:
    """Samples every worker's results within ``budget`` of its work; raises Lost on a wrong one.

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
        self._image: dict[int, list[float]] = {}  # layer -> its image samples' seconds and kernel-channel-images
        self.master_rate: dict[int, float] = {}  # layer -> the master's seconds per kernel-channel-image, own share

    def __call__(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        """Check worker ``k``'s ``reply`` (float32, well formed) to ``task`` on the master's backend ``be``."""
        if task.kind not in TASKS:
            return
        state, layer = self.workers.setdefault(k, _Worker()), task.header["layer"]
        if task.kind == "block_forward":  # a layer's step begins
            state.views[layer], state.samples[layer] = ByKernels(task), []
        elif task.kind == "partial_forward" and "w" in task.arrays:
            state.views[layer], state.samples[layer] = ByChannels(task), []
        view = state.views.get(layer)
        if view is None or task.header["step"] != view.step:
            return
        reached = view.add(task, reply)
        if reached == "unfit":  # not this file's to judge: the split's shape check loses the worker
            del state.views[layer]
        elif reached == "forward":
            self._forward(k, state, layer, be)
        elif reached == "backward":
            self._backward(k, state, layer, be)

    def _place(self, view: Any, kind: str, besides: list[int], among: range | None = None) -> int | None:
        choices = [i for i in (view.places(kind) if among is None else among) if i not in besides]
        return int(self.rng.choice(choices)) if choices else None

    def _spend(self, state: _Worker, kind: str, t0: float, cells: float, layer: int) -> None:
        """Take a sample's seconds since ``t0`` off its kind's credit (``cells``: its kernel-channel-images)."""
        dt = time.perf_counter() - t0
        state.credit[layer][kind] -= dt
        self.seconds += dt
        if kind == "image":
            spent = self._image.setdefault(layer, [0.0, 0.0])
            spent[0] += dt
            spent[1] += cells

    def _forward(self, k: int, state: _Worker, layer: int, be: Backend) -> None:
        view = state.views[layer]
        spent, cells = self._image.get(layer, (0.0, 0.0))
        rate = self.master_rate.get(layer) or (spent / cells if cells else 0.0)  # master s per kernel-channel-image
        credit = state.credit.setdefault(layer, dict.fromkeys(SHARES, 0.0))
        step = self.budget * 3 * view.work * rate  # this step's credit, in master seconds
        for kind, share in SHARES.items():
            if kind == "kernel" and (spare := credit["image"] - SHARES["image"] * step) > 0:  # to dw's samples
                credit["kernel"], credit["image"] = credit["kernel"] + spare, credit["image"] - spare
            earned = share * step
            credit[kind] += earned
            self.earned += earned
            if credit[kind] < 0 or (at := self._place(view, kind, [])) is None:
                continue
            t0 = time.perf_counter()
            sample = view.sample(kind, at, be)
            self.samples += 1
            pairs = view.forward_pairs(sample, be)
            self._spend(state, kind, t0, view.work / view.images, layer)
            self._judge(k, f"its forward, in {kind} {at}", pairs)
            state.samples[layer].append(sample)

    def _backward(self, k: int, state: _Worker, layer: int, be: Backend) -> None:
        view = state.views.pop(layer)
        for sample in state.samples.pop(layer):
            t0 = time.perf_counter()
            pairs = view.backward_pairs(sample, be)
            agree, seen = _agree(pairs), [sample.at]
            alike = view.alike(sample)  # where a confirming sample checks the same numbers
            while not agree and len(seen) < 3 and (at := self._place(view, sample.kind, seen, alike)) is not None:
                agree = _agree(view.backward_pairs(view.sample(sample.kind, at, be), be))
                self.forgiven += agree  # round-off flipped a tie in the first sample, not a wrong worker
                seen.append(at)
            self._spend(state, sample.kind, t0, 2 * view.work / view.images, layer)
            if not agree:
                self._judge(k, f"its backward, in {sample.kind} {sample.at}", pairs)

    def _judge(self, k: int, where: str, pairs: list[Pair]) -> None:
        for got, ref, tol in pairs:
            err = float(np.max(np.abs(got - ref), initial=0.0))
            if not err <= tol:
                self.workers.pop(k, None)
                why = f"wrong result: {where} differs from the master's by {err:.3g} (round-off allows {tol:.3g})"
                raise Lost({k: why}, wrong=True)


def _agree(pairs: list[Pair]) -> bool:
    return all(np.all(np.abs(got - ref) <= tol) for got, ref, tol in pairs)
