"""Spot checks of the splits by images (data parallelism, the hybrid): one image of a worker's slice run forward
each step, a data-parallel gradient's last bias against its logits, and now and then the whole task replayed.

Its budget and tolerances: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import time
from collections.abc import Callable

import numpy as np

from backends.base import Backend
from backends.conformance.checks import FN, scale
from tinyconv.distributed.replica import flat, probe
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape
from tinyconv.distributed.replica.free_checks import last_bias, last_norm
from tinyconv.distributed.replica.replica import build
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.spot_sample import Pair, pair
from tinyconv.distributed.worker.handler import Worker
from tinyconv.layers import BatchNorm2D, Conv2D, Linear, LocalResponseNorm
from tinyconv.model import Network
from transports.base import Message


def roundings(net: Network, x_shape: tuple[int, ...]) -> tuple[int, int]:
    """k of ``net``'s outputs, and of its gradients, on x (N, C, H, W): the reductions on the longest path.

    Forward: a convolution's C K K products and its bias, a linear layer's inputs, batch norm's mean and
    variance over N H W, LRN's ``size`` squares and its pow. Backward, on top: dx's F K K (or the linear
    layer's outputs), dw's N OH OW (or N), batch norm's two sums over N H W again, LRN again."""
    forward = backward = 0
    shape = x_shape
    for layer in net.layers:
        out = layer.output_shape(shape)
        if isinstance(layer, Conv2D):
            f, c, kh, kw = layer.params["w"].shape
            forward += c * kh * kw + 1
            backward += f * kh * kw + out[0] * out[2] * out[3]
        elif isinstance(layer, Linear):
            n_out, n_in = layer.params["w"].shape  # (M, D)
            forward += n_in + 1
            backward += n_out + shape[0]
        elif isinstance(layer, (BatchNorm2D, LocalResponseNorm)):  # as many roundings back as forth
            norm = 2 * shape[0] * shape[2] * shape[3] if isinstance(layer, BatchNorm2D) else layer.size + 2
            forward, backward = forward + norm + FN, backward + norm + FN
        shape = out
    return forward, forward + backward


REPLAYS = 1 / 3  # the budget's share kept for replays, the only check of a wrong dY its layers' sums follow
KERNELS = 1 / 6  # the hybrid's share for its kernel samples: 1-2 % of a task each at 50:500 on 21 images


class ReplayCheck:
    """Checks every worker's replica tasks within ``budget`` of its work; raises Lost on a wrong one.

    Each step of a worker: the hybrid's features of one image and kernel; while its image credit lasts, one
    random image of its slice run forward (the logits it sent, or the hybrid's features); the last bias against
    the logits, or the hybrid's last norm against the features; each convolution's dW against its probe; and,
    from a third of the budget and always at the worker's first step, its whole task replayed (the module's
    docstring; docs/how-it-works.md). What it did: ``images`` checked, ``samples`` (tasks replayed),
    ``seconds`` the master spent on all of it, ``earned`` the seconds the budget allowed. ``local`` is the
    master's own worker that replays (on the backend of the first call)."""

    def __init__(self, budget: float = 0.03, seed: int | None = None) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"the spot-check budget is a fraction of each worker's work in (0, 1], got {budget!r}")
        self.budget = budget
        self.credit: dict[int, float] = {}  # worker -> master seconds for replays; none yet: its first is due
        self.image_credit: dict[int, float] = {}  # worker -> master seconds for image checks
        self.kernel_credit: dict[int, float] = {}  # worker -> master seconds for the hybrid's kernel samples
        self.forward: dict[int, tuple[Message, Message, bool]] = {}  # worker -> its hybrid_forward, answer, replay?
        self.samples, self.images, self.seconds, self.earned = 0, 0, 0.0, 0.0
        self.doubts: dict[int, int] = {}  # worker -> its replays in a row whose backward disagreed
        self.forgiven = 0  # backward disagreements the next replays did not confirm
        self._image_s = 0.0  # what the last image check cost the master
        self.master_rate = 0.0  # the master's seconds per image of a whole task, on its own slice
        self._replayed = [0.0, 0]  # seconds, images: the rate until the master measures its own
        self.local: Worker | None = None
        self._rng = np.random.default_rng(seed)  # the image: the master's choice, made after the answer came
        self._net: tuple[str, Network] | None = None  # the image checks' replica
        self._top: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # worker -> its next probe's (u, v)s
        self._trail: dict[int, collections.deque] = {}  # worker -> its last steps' projections (probe.window_tolerance)

    def __call__(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        """Check worker ``k``'s ``reply`` (float32, well formed) to ``task`` on the master's backend ``be``."""
        if task.kind == "hybrid_backward" and k in self.forward:
            first, answer, due = self.forward.pop(k)
            if self._net is not None:
                net = self._net[1]
                self._charged(k, task.kind, lambda: last_norm(first, answer, task, reply, net, self._rng), due)
                self._charged(k, task.kind, lambda: self._projections(k, first, reply, conv_part(net)), due)
            if due:
                self._replay(k, [(first, answer), (task, reply)], be)
        elif task.kind in ("replica_step", "hybrid_forward"):  # a step's first task: it earns, and is checked
            self.forward.pop(k, None)
            due = self._check_step(k, task, reply, be)
            if task.kind == "replica_step" and self._net is not None:
                net = self._net[1]
                self._charged(k, task.kind, lambda: self._projections(k, task, reply, net), due)
            if due and task.kind == "replica_step":
                self._replay(k, [(task, reply)], be)
            elif task.kind == "hybrid_forward":  # for its backward: replayed with it, if due (it needs its caches)
                self.forward[k] = (task, reply, due)

    def _check_step(self, k: int, task: Message, reply: Message, be: Backend) -> bool:
        """Earn the step's credit; check one image while the image credit holds what one last cost (so that the
        next steps' free checks keep theirs), a data-parallel step's last bias while it is not negative (and at
        the worker's first step); what the image credit holds beyond a step's share, or an image's, goes to the
        replays. Whether a replay is due: the first step, or credit saved for it (``self.credit[k] >= 0`` after)."""
        net = self._built(task, be)
        if net is None or not _fits(task, reply, net):
            return False  # not this file's to judge: the split's shape check loses the worker
        images = task.arrays["x"].shape[0]
        rate = self.master_rate or (self._replayed[0] / self._replayed[1] if self._replayed[1] else 0.0)
        earned = self.budget * rate * images
        self.earned += earned
        first = k not in self.credit
        self.credit[k] = self.credit.get(k, 0.0) + earned * REPLAYS
        share = earned * (1 - REPLAYS)  # the images', with what the kernel samples leave
        part = net if task.kind == "replica_step" else conv_part(net)
        extra = functools.cache(lambda: self._loaded(task, reply, part))  # once a step, for the checks that run
        if task.kind == "hybrid_forward":  # a few kernels of one image: at the paper's sizes, most steps
            kernels = self.kernel_credit.get(k, 0.0) + earned * KERNELS
            if not first and kernels >= 0:
                t0 = time.perf_counter()
                self._judge(k, task.kind, [self._one_kernel(task, reply, net, extra())])
                dt = time.perf_counter() - t0
                kernels -= dt
                self.seconds += dt
            self.kernel_credit[k] = min(kernels, earned * KERNELS)  # a step's share kept, the rest to the images
            share += kernels - self.kernel_credit[k] - earned * KERNELS
        mine = self.image_credit.get(k, 0.0) + share
        t0 = time.perf_counter()
        if not first and mine >= self._image_s:  # what it last cost: the next steps' free checks keep theirs
            self.images += 1
            self._judge(k, task.kind, [self._one_image(task, reply, part, extra())])
            self._image_s = time.perf_counter() - t0
        if task.kind == "replica_step" and (first or mine - (time.perf_counter() - t0) >= 0):
            self._judge(k, task.kind, [last_bias(task, reply, net)])
        dt = time.perf_counter() - t0
        self.seconds += dt
        spare = max(0.0, mine - dt - max(share, self._image_s))  # kept: a step's share or an image's, the rest
        self.image_credit[k] = mine - dt - spare  # to the replays
        self.credit[k] += spare
        return first or self.credit[k] >= 0

    def _charged(self, k: int, kind: str, parts: Callable[[], list[tuple[str, Pair]]], replayed: bool) -> None:
        """Judge the ``parts`` a check makes while worker k's image credit is not negative (free checks cost little
        at the paper's sizes, more than a small network's 3 %), or beside a replay; its seconds taken off that
        credit."""
        if self.image_credit.get(k, 0.0) < 0 and not replayed:
            return
        t0 = time.perf_counter()
        try:
            self._judge(k, kind, parts())
        finally:
            dt = time.perf_counter() - t0
            self.seconds += dt
            if k in self.image_credit:
                self.image_credit[k] -= dt

    def probe_for(self, k: int, part: Network) -> dict[str, np.ndarray]:
        """The ``probe`` for worker k's next ``replica_step`` (``part``: the network) or ``hybrid_forward`` (its
        conv part): the top singular pair of each convolution's dW it last sent (``probe.py``); none before."""
        pairs = self._top.get(k)
        if not pairs or sum(u.size + v.size for u, v in pairs) != probe.size(part):
            return {}
        return {"probe": np.concatenate([np.concatenate([u, v]) for u, v in pairs]).astype(np.float32)}

    def _projections(self, k: int, first: Message, reply: Message, part: Network) -> list[tuple[str, Pair]]:
        """Each convolution's u^T dW v of the gradient the worker sent, against its own sum s of the products,
        within ``probe.tolerance`` (k its ``roundings``; s rounded to float32 once more); its next probe taken
        from this dW."""
        grads, got, sent = reply.arrays.get("grads"), reply.arrays.get("probes"), first.arrays.get("probe")
        if grads is None or grads.shape != (sum(flat.sizes(part)),):
            return []
        at = flat.spans(part)
        dws = [grads[at[f"{c.name}.w"]].reshape(c.out_channels, -1) for c in probe.convs(part)]
        out, names = [], [f"the gradient of {c.name}.w against its projection" for c in probe.convs(part)]
        if sent is not None and got is not None and got.shape == (2 * len(dws),):
            lengths = probe.roundings(part, first.arrays["x"].shape)
            rows = []
            for what, dw, (u, v), (s, a), n in zip(
                names, dws, probe.pairs(part, sent), got.reshape(-1, 2), lengths, strict=True
            ):
                ref = float(u @ (dw @ v.ravel()))
                tol = probe.tolerance(n, float(a)) + 2**-23 * abs(float(s))
                out.append((what, (s.reshape(1), np.array([ref]), tol)))
                rows.append((float(s), ref, n, float(a)))
            trail = self._trail.setdefault(k, collections.deque(maxlen=probe.WINDOW))
            if trail and trail[-1].shape != (len(rows), 4):  # another network: its sums start again
                trail.clear()
            trail.append(np.array(rows))
            steps = np.stack(trail)  # (L, convolutions, 4): the last L checked steps' s, u^T dW v, k, a
            for length, (i, what) in itertools.product(range(2, len(steps) + 1), enumerate(names)):
                r = steps[-length:, i]
                sums = (np.array([r[:, 0].sum()]), np.array([r[:, 1].sum()]), probe.window_tolerance(r))
                out.append((f"{what}s summed over its last {length} steps", sums))
        last = self._top.get(k) or [None] * len(dws)
        self._top[k] = [probe.top_pair(dw, start) for dw, start in zip(dws, last, strict=True)]
        return out

    def _built(self, task: Message, be: Backend) -> Network | None:
        """The replica ``task`` describes, on ``be``, for the image checks (None if it describes none)."""
        spec = task.header.get("net")
        key = repr(sorted(spec.items())) if isinstance(spec, dict) else ""
        if self._net is None or self._net[0] != key or self._net[1].backend is not be:
            try:
                self._net = key, build(spec, be, 1)
            except (ValueError, TypeError, AttributeError):
                return None
        return self._net[1]

    def _loaded(self, task: Message, reply: Message, part: Network) -> int:
        """``part`` (the replica, or its conv part) with the task's weights and, as its running statistics, the
        worker's batch statistics, for an evaluation forward; the roundings that adds (``_slice_statistics``)."""
        flat.unpack(part, task.arrays["params"])
        return _slice_statistics(part, reply.arrays.get("stats"), task.arrays["x"].shape)

    def _one_image(self, task: Message, reply: Message, part: Network, extra: int) -> tuple[str, Pair]:
        """One random image of the slice run forward on the master by ``part`` (``_loaded``: ``extra`` its
        roundings), against the worker's row of logits (or features)."""
        be, x = part.backend, task.arrays["x"]
        j = int(self._rng.integers(len(x)))
        name = "logits" if task.kind == "replica_step" else "features"
        got = reply.arrays[name][j : j + 1]
        mine = np.asarray(be.to_numpy(part.forward(be.asarray(x[j : j + 1].copy()), training=False)), np.float32)
        return f"image {j}'s {name}", pair(got, mine.reshape(got.shape), roundings(part, x.shape)[0] + extra)

    def _one_kernel(self, task: Message, reply: Message, net: Network, extra: int) -> tuple[str, Pair]:
        """The hybrid's features of one random image and one random kernel j of its last convolution, on the
        master: the layers before that convolution on the one image, then of it only the kernels j's tail reads
        ([j - E, j + E], E the LRN's half-window; batch norm at the worker's statistics, as an evaluation). j is
        drawn among the kernels whose plane the worker sent is not all zeros (the whole image checks those).
        ``net``'s conv part is ``_loaded``, ``extra`` its roundings."""
        be, x = net.backend, task.arrays["x"]
        conv = conv_part(net)
        last = max(i for i, layer in enumerate(conv.layers) if isinstance(layer, Conv2D))
        layer, tail = conv.layers[last], conv.layers[last + 1 :]
        i = int(self._rng.integers(len(x)))
        planes = reply.arrays["features"][i].reshape(feature_shape(net, task.header["net"]["image_size"]))
        live = np.flatnonzero(np.any(planes != 0, axis=(1, 2)))  # a plane ReLU silenced shows no scaling
        j = int(self._rng.choice(live)) if live.size else int(self._rng.integers(layer.out_channels))
        e = max((t.size // 2 for t in tail if isinstance(t, LocalResponseNorm)), default=0)
        span = slice(max(0, j - e), min(layer.out_channels, j + e + 1))
        h = Network(be, conv.layers[:last]).forward(be.asarray(x[i : i + 1].copy()), training=False)
        w, b = (be.asarray(be.to_numpy(layer.params[p])[span].copy()) for p in ("w", "b"))
        out, _ = be.conv2d_forward(h, w, b, layer.stride, layer.padding)
        top = scale(be.to_numpy(out))  # ReLU can leave far less than the sums it cut: the forward's scale
        for t in tail:
            if isinstance(t, BatchNorm2D):  # its entries over the span, in a norm of their own
                part = BatchNorm2D(be, span.stop - span.start, t.momentum, t.eps)
                for table in ("params", "buffers"):
                    for name, a in getattr(t, table).items():
                        getattr(part, table)[name] = be.asarray(be.to_numpy(a)[span].copy())
                t = part
            out = t.forward(out, training=False)
        mine = np.asarray(be.to_numpy(out), np.float32)[0, j - span.start]
        got = planes[j]
        return f"image {i}'s features of kernel {j}", pair(got, mine, roundings(conv, x.shape)[0] + extra, top)

    def _replay(self, k: int, got: list[tuple[Message, Message]], be: Backend) -> None:
        """Run the worker's own handler on the tasks it got, and judge every array of its answers."""
        t0 = time.perf_counter()
        if self.local is None:
            self.local = Worker(be)
        pairs = [(mine, theirs) for sent, theirs in got for mine in [self.local.handle(sent)]]
        dt = time.perf_counter() - t0
        self.credit[k] = self.credit.get(k, 0.0) - dt
        self.seconds += dt
        self.samples += 1
        first = got[0][0]
        self._replayed = [self._replayed[0] + dt, self._replayed[1] + first.arrays["x"].shape[0]]
        net = self.local.state.replica[1]
        part = net if first.kind == "replica_step" else conv_part(net)
        forward, backward = roundings(part, first.arrays["x"].shape)
        doubt = None
        for mine, theirs in pairs:
            if mine.kind != "result":  # the master's replay failed where the worker did not: no verdict
                return
            for name, ref in mine.arrays.items():
                answer = theirs.arrays.get(name)
                if answer is None or answer.shape != ref.shape:
                    return  # not this file's to judge: the split's shape check loses the worker
                parts = _parts(part, name, ref, answer, backward if name == "grads" else forward)
                if name in ("grads", "probes"):  # the backward's: judged below
                    doubt = doubt or _worst(parts)
                else:
                    self._judge(k, first.kind, parts)
        if doubt is None:
            self.forgiven += self.doubts.pop(k, 0) > 0
            return
        self.doubts[k] = self.doubts.get(k, 0) + 1
        if self.doubts[k] >= 3:
            self._judge(k, first.kind, [doubt[0]])
        self.credit[k] = max(self.credit[k], 0.0)  # the next step is replayed too

    def _judge(self, k: int, kind: str, parts: list[tuple[str, Pair]]) -> None:
        """Lose worker ``k`` ("wrong result") at the first entry beyond its tolerance (a scalar or one per entry)."""
        bad = _worst(parts)
        if bad is not None:
            (what, (got, ref, tol)), i = bad
            gap = np.abs(got.astype(np.float64) - ref)
            self.credit.pop(k, None)
            self.image_credit.pop(k, None)
            self._top.pop(k, None)
            self._trail.pop(k, None)
            self.doubts.pop(k, None)
            why = f"wrong result: {what} in its {kind} differs from the master's by {gap.flat[i]:.3g}"
            raise Lost({k: f"{why} (round-off allows {np.broadcast_to(tol, gap.shape).flat[i]:.3g})"}, wrong=True)


def _worst(parts: list[tuple[str, Pair]]) -> tuple[tuple[str, Pair], int] | None:
    """The first part with an entry beyond its tolerance (NaN is), and that entry's flat index; None if none."""
    for what, (got, ref, tol) in parts:
        excess = np.nan_to_num(np.abs(got.astype(np.float64) - ref) - tol, nan=np.inf)
        if excess.size and (i := int(np.argmax(excess))) >= 0 and excess.flat[i] > 0:
            return (what, (got, ref, tol)), i
    return None


def _fits(task: Message, reply: Message, net: Network) -> bool:
    """Whether ``reply`` has the arrays a step of ``net``'s replica (or conv part) on ``task``'s slice answers with."""
    n = task.arrays["x"].shape[0]
    if task.kind == "replica_step":
        part, shapes = net, {"logits": (n, net.layers[-1].params["b"].shape[0])}
        shapes["grads"] = (sum(flat.sizes(net)),)
    else:
        part, shapes = (
            conv_part(net),
            {"features": (n, math.prod(feature_shape(net, task.header["net"]["image_size"])))},
        )
    if "buffers" in task.arrays:
        shapes["stats"] = (sum(flat.sizes(part, "buffers")),)
    return all(name in reply.arrays and reply.arrays[name].shape == shape for name, shape in shapes.items())


def _slice_statistics(net: Network, stats: np.ndarray | None, x_shape: tuple[int, ...]) -> int:
    """Set each batch norm's running statistics to the worker's batch mean and biased variance over its slice x
    (``x_shape``), from the ``stats`` it returned (the unbiased variance is M / (M - 1) times the biased one,
    M = n H W), so that an evaluation forward normalises as its training one did. Returns the roundings that
    adds: the scaling to the unbiased variance and back."""
    if stats is None:
        return 0
    flat.unpack(net, stats, "buffers")
    shape = x_shape
    for layer in net.layers:
        if isinstance(layer, BatchNorm2D):
            m = shape[0] * shape[2] * shape[3]
            var = layer.backend.to_numpy(layer.buffers["running_var"]).astype(np.float64) * (max(m - 1, 1) / m)
            var = np.maximum(var, 0.0)  # a wrong worker's: its image's numbers will not match
            layer.buffers["running_var"] = layer.backend.asarray(var.astype(np.float32))
        shape = layer.output_shape(shape)
    return 2


def _parts(net: Network, name: str, ref: np.ndarray, got: np.ndarray, k: int) -> list[tuple[str, Pair]]:
    """(what, (the worker's, the master's, their tolerance)) of an answer's array: a gradient vector split by
    parameter, each on the scale of its layer's largest gradient entry (a convolution's bias before batch norm
    has a gradient of 0 but for round-off: its sums cancel, its weights' do not); any other array whole."""
    if name != "grads":
        return [(name, pair(got, ref, k))]
    at = flat.spans(net)
    parts = [(p, layer, ref[at[p]], got[at[p]]) for p, layer, _ in net.named_params()]
    top = {id(layer): max(scale(r) for _, other, r, _ in parts if other is layer) for _, layer, _, _ in parts}
    return [(f"the gradient of {p}", pair(g, r, k, top[id(layer)])) for p, layer, r, g in parts]
