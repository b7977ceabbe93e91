"""Spot checks of the splits by images (data parallelism, the hybrid): one image of a worker's slice run forward,
and one forward and backward, a data-parallel gradient's last bias against its logits, each dW against its
projection and two ops inside the backward against their sums, and now and then the whole task replayed.

Its budget and tolerances: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from backends.base import Backend
from backends.conformance.checks import scale
from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.replica import flat, image_backward, inner_ops, magnitudes, one_image, probe
from tinyconv.distributed.replica.conv_part import conv_part, feature_shape
from tinyconv.distributed.replica.free_checks import last_bias, last_norm
from tinyconv.distributed.replica.one_image import roundings
from tinyconv.distributed.replica.replica import build
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.spot_sample import Pair, clock, pair, worst
from tinyconv.distributed.worker.handler import Worker
from tinyconv.model import Network
from transports.base import Message

REPLAYS = 1 / 6  # the budget's share kept for replays
BACKWARDS = 2 / 3  # for one image's backward, the check of a wrong dY its layers' sums follow: 8 % of a task
IMAGES = 1 - REPLAYS - BACKWARDS  # the image credit's, for the free checks and the images (and the kernels)
KERNELS = 1 / 12  # the hybrid's share for its kernel samples (one feature): 0.3 % of a task each at 50:500, 21 images


class ReplayCheck:
    """Checks every worker's replica tasks within ``budget`` of its work; raises Lost on a wrong one.

    Each step of a worker, the last bias against its logits or the hybrid's last norm against its features; as
    its credit allows, the hybrid's feature of one image and kernel at one place, one image forward, each dW against
    its probe and the ops inside (``_sums``), from two thirds of the budget one image forward and backward
    (``image_backward.py``), from a sixth (always at the first step) its whole task replayed. ``images`` checked
    forward alone, ``backwards`` forward and backward, ``samples`` (tasks replayed), ``seconds`` the master spent
    on all of it, ``earned`` the seconds the budget allowed. ``local``: the master's worker that replays."""

    def __init__(self, budget: float = 0.03, seed: int | None = None) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"the spot-check budget is a fraction of each worker's work in (0, 1], got {budget!r}")
        self.budget = budget
        self.credit: dict[int, float] = {}  # worker -> master seconds for replays; none yet: its first is due
        self.image_credit: dict[int, float] = {}  # worker -> master seconds for image checks
        self.kernel_credit: dict[int, float] = {}  # worker -> master seconds for the hybrid's kernel samples
        self.back_credit: dict[int, float] = {}  # worker -> master seconds for one image's backward
        self._back_s, self.backwards = 0.0, 0  # what the last one cost the master; how many ran
        self.forward: dict[int, tuple[Message, Message, bool]] = {}  # worker -> its hybrid_forward, answer, replay?
        self.samples, self.images, self.seconds, self.earned = 0, 0, 0.0, 0.0
        self.forgiven = 0  # disagreements a closer look cleared: replayed gradients, or a doubted image's e_j
        self._doubted: set[int] = set()  # the workers of one image whose last e_j was beyond its bound
        self._numpy = NumpyBackend()  # the backward of absolute values' (magnitudes.py)
        self._image_s, self._replay_s = 0.0, 0.0  # what the last image check, and the last replay, cost the master
        self.master_rate = 0.0  # the master's seconds per image of a whole task, on its own slice
        self._replayed = [0.0, 0]  # seconds, images: the rate until the master measures its own
        self.local: Worker | None = None
        self._rng = np.random.default_rng(seed)  # the image: the master's choice, made after the answer came
        self._replicas: dict[str, tuple[str, Network]] = {}  # use -> (its description, the replica: _built)
        self._top: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # worker -> its next probe's (u, v)s
        self._trails = probe.Trails()  # (worker, check) -> its last rows

    def __call__(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        """Check worker ``k``'s ``reply`` (float32, well formed) to ``task`` on the master's backend ``be``."""
        asked = self.forward[k][0] if task.kind == "hybrid_backward" and k in self.forward else task
        if task.kind != "hybrid_forward" and "probe" in asked.arrays and "probes" not in reply.arrays:
            self._lose(k, f"wrong result: asked for the sums along its probe, its {task.kind} sent none")
        if task.kind == "hybrid_backward" and k in self.forward:
            first, answer, due = self.forward.pop(k)
            if "checks" in self._replicas:
                net = self._replicas["checks"][1]
                self._charged(k, task.kind, lambda: last_norm(first, answer, task, reply, net, self._rng), floor=True)
                self._charged(k, task.kind, lambda: self._sums(k, first, answer, reply, net), due)
                if _fits(first, answer, net):
                    d = task.arrays["dfeatures"]
                    self._backward_check(
                        k, task.kind, lambda: self._image_back(k, first, answer, reply, conv_part(net), d)
                    )
            if due:
                self._replay(k, [(first, answer), (task, reply)], be)
        elif task.kind in ("replica_step", "hybrid_forward"):  # a step's first task: it earns, and is checked
            self.forward.pop(k, None)
            due = self._check_step(k, task, reply, be)
            if task.kind == "replica_step" and "checks" in self._replicas:
                net = self._replicas["checks"][1]
                self._charged(k, task.kind, lambda: self._sums(k, task, reply, reply, net), due)
                if _fits(task, reply, net):
                    self._backward_check(k, task.kind, lambda: self._image_back(k, task, reply, reply, net))
            if due and task.kind == "replica_step":
                self._replay(k, [(task, reply)], be)
            elif task.kind == "hybrid_forward":  # for its backward: replayed with it, if due (it needs its caches)
                self.forward[k] = (task, reply, due)

    def _check_step(self, k: int, task: Message, reply: Message, be: Backend) -> bool:
        """Earn the step's credit; check one image while the image credit holds what one last cost (so that the
        next steps' free checks keep theirs), a data-parallel step's last bias whatever the credit (the floor,
        ``_charged``); the image credit beyond a step's share, or an image's, goes to the replays. Whether a replay
        is due: the first step, or replay credit that holds what the last one cost (the run within its budget)."""
        net = self._built(task, be)
        if net is None or not _fits(task, reply, net):
            return False  # not this file's to judge: the split's shape check loses the worker
        images = task.arrays["x"].shape[0]
        rate = self.master_rate or (self._replayed[0] / self._replayed[1] if self._replayed[1] else 0.0)
        earned = self.budget * rate * images
        self.earned += earned
        first = k not in self.credit
        self.credit[k] = self.credit.get(k, 0.0) + earned * REPLAYS
        self.back_credit[k] = self.back_credit.get(k, 0.0) + earned * BACKWARDS
        share = earned * IMAGES
        part = net if task.kind == "replica_step" else conv_part(net)
        extra = functools.cache(lambda: self._loaded(task, reply, part))  # once a step, for the checks that run
        if task.kind == "hybrid_forward":  # a few kernels of one image: at the paper's sizes, most steps
            kernels = self.kernel_credit.get(k, 0.0) + earned * KERNELS
            if not first and kernels >= 0:
                t0 = clock()
                self._judge(k, task.kind, [one_image.kernel(task, reply, net, extra(), self._rng)])
                dt = clock() - t0
                kernels -= dt
                self.seconds += dt
            self.kernel_credit[k] = min(kernels, earned * KERNELS)  # a step's share kept, the rest to the images
            share += kernels - self.kernel_credit[k] - earned * KERNELS
        mine = self.image_credit.get(k, 0.0) + share
        t0 = clock()
        if not first and mine >= self._image_s:  # what it last cost: the next steps' free checks keep theirs
            self.images += 1
            self._judge(
                k,
                task.kind,
                [one_image.image(task, reply, part, extra(), int(self._rng.integers(len(task.arrays["x"]))))],
            )
            self._image_s = clock() - t0
        dt = clock() - t0
        self.seconds += dt
        spare = max(0.0, mine - dt - max(share, self._image_s))  # kept: a step's share or an image's, the rest
        self.image_credit[k] = mine - dt - spare  # to the replays
        self.credit[k] += spare
        if task.kind == "replica_step":
            self._charged(k, task.kind, lambda: [last_bias(task, reply, net)], floor=True)
        return first or self.credit[k] >= self._replay_s

    def _backward_check(self, k: int, kind: str, parts: Callable[[], list[tuple[str, Pair]]]) -> None:
        """Judge one image's backward (``_image_back``) while worker k's backward credit holds what the last one
        cost, its seconds taken off that credit; the credit kept up to what two cost."""
        credit = self.back_credit.get(k)
        if credit is None:
            return
        if credit >= self._back_s:
            t0 = clock()
            ran = self.backwards
            try:
                self._judge(k, kind, parts())
            finally:
                dt = clock() - t0
                self._back_s = dt / (self.backwards - ran) if self.backwards > ran else self._back_s  # none: no probe
                self.seconds += dt
                credit -= dt
        if k in self.back_credit:
            self.back_credit[k] = min(credit, 2 * self._back_s)
            if k in self._doubted:  # a slice of one image: the next step's decides, whatever the credit
                self.back_credit[k] = max(self.back_credit[k], self._back_s)

    def _charged(
        self,
        k: int,
        kind: str,
        parts: Callable[[], list[tuple[str, Pair]]],
        replayed: bool = False,
        floor: bool = False,
    ) -> None:
        """Judge the ``parts`` a check makes while worker k's image credit, or else its backward credit, is not
        negative (free checks cost little at the paper's sizes; a small network's come before the backward), or beside a
        replay; its seconds taken off that credit. The ``floor`` of every step (the last bias, or the hybrid's last
        norm: a result x -50 caught at its first step on any network) runs whatever the credit, every share paying
        in proportion: the checks stay within the budget while it costs less than it (at 16:32, 1-3 % of a task)."""
        credits = self.image_credit if self.image_credit.get(k, 0.0) >= 0 else self.back_credit
        if credits.get(k, 0.0) < 0 and not (replayed or floor):
            return
        pay = [(self.credit, REPLAYS), (self.back_credit, BACKWARDS), (self.image_credit, IMAGES)] if floor else []
        t0 = clock()
        try:
            self._judge(k, kind, parts())
        finally:
            dt = clock() - t0
            self.seconds += dt
            for paying, share in pay or [(credits, 1.0)]:
                if k in paying:
                    paying[k] -= dt * share

    def probe_for(self, k: int, part: Network) -> dict[str, np.ndarray]:
        """The ``probe`` for worker k's next ``replica_step`` (``part``: the network) or ``hybrid_forward`` (its conv
        part): the top singular pair of each dW it last sent, then where to sample dX (``inner_ops``); none before."""
        pairs = self._top.get(k)
        sent = np.concatenate([*(np.concatenate([u, v]) for u, v in pairs or []), self._rng.random(probe.WHERE)])
        return {"probe": sent.astype(np.float32)} if pairs and sent.size == probe.size(part) else {}

    def _sums(self, k: int, first: Message, answer: Message, reply: Message, net: Network) -> list[tuple[str, Pair]]:
        """The sums worker k sent beside its gradient (``reply``; ``answer`` its step's first), for the replica ``net``:
        each dW's projection (``_projections``), and the ops inside its backward (``inner_ops.py``)."""
        part = net if first.kind == "replica_step" else conv_part(net)
        return self._projections(k, first, reply, part) + inner_ops.check(first, answer, reply, net)

    def _projections(self, k: int, first: Message, reply: Message, part: Network) -> list[tuple[str, Pair]]:
        """Each convolution's u^T dW v of ``part`` (the replica or its conv part) against the worker's sum s, within
        ``probe.tolerance`` (k its ``roundings``; s rounded to float32 once more); its next probe from this dW."""
        grads, got, sent = reply.arrays.get("grads"), reply.arrays.get("probes"), first.arrays.get("probe")
        if grads is None or grads.shape != (sum(flat.sizes(part)),):
            return []
        at = flat.spans(part)
        dws = [grads[at[f"{c.name}.w"]].reshape(c.out_channels, -1) for c in probe.convs(part)]
        out, names = [], [f"the gradient of {c.name}.w against its projection" for c in probe.convs(part)]
        if sent is not None and got is not None and got.shape == (len(dws) * (2 + len(first.arrays["x"])),):
            lengths = probe.roundings(part, first.arrays["x"].shape)
            rows = []
            for what, dw, (u, v), (s, a), n in zip(
                names, dws, probe.pairs(part, sent), got.reshape(len(dws), -1)[:, :2], lengths, strict=True
            ):
                one, row = probe.compared(dw, u, v, float(s), float(a), n)
                out.append((what, one))
                rows.append(row)
            out += self._trails((k, "dW"), names, rows)
        last = self._top.get(k) or [None] * len(dws)
        self._top[k] = [probe.top_pair(dw, start) for dw, start in zip(dws, last, strict=True)]
        return out

    def _image_back(
        self,
        k: int,
        first: Message,
        answer: Message,
        reply: Message,
        part: Network,
        dfeatures: np.ndarray | None = None,
    ) -> list[tuple[str, Pair]]:
        """One random image of the slice forward and backward on the master (``image_backward.check``), and its
        e_j's disagreements summed over the last checks. An e_j beyond its bound is doubted: where the worker's
        forward broke a tie the other way, a whole entry of dY differs, which round-off's bound does not cover
        (about one image in 4,000 at 16:32). Another image of the slice then decides at once (a fault moves every
        image's e_j; a tie is one image's): the worker is lost if it is beyond its bound too. A slice of one image
        leaves it to the worker's next step."""
        x, got = first.arrays["x"], reply.arrays.get("probes")
        convs = probe.convs(part)
        grads = reply.arrays.get("grads")
        if "probe" not in first.arrays or got is None or got.shape != (len(convs) * (2 + len(x)),):
            return []
        if grads is None or grads.shape != (sum(flat.sizes(part)),):
            return []
        extra, j = self._loaded(first, answer, part), int(self._rng.integers(len(x)))
        doubted = k in self._doubted
        self._doubted.discard(k)
        while True:
            self.backwards += 1
            parts, rows = image_backward.check(first, answer, reply, part, j, extra, dfeatures)
            bad = worst(parts[1:]) is not None
            if not bad or doubted:
                break
            doubted = True  # a tie (ReLU's sign, a pool's maximum) moves a whole entry: another image decides
            if len(x) == 1:
                self._doubted.add(k)
                return parts[:1]
            j = (j + 1 + int(self._rng.integers(len(x) - 1))) % len(x)
        self.forgiven += doubted and not bad
        return parts + self._trails((k, "dY"), [f"one image's sum of dY^2 at {c.name}" for c in convs], rows)

    def _built(self, task: Message, be: Backend, use: str = "checks") -> Network | None:
        """The replica ``task`` describes, on ``be``, kept for ``use`` ("checks": the image checks', on the
        master's backend; "magnitudes": on numpy), built again when either changes (None if it describes none)."""
        spec = task.header.get("net")
        key = repr(sorted(spec.items())) if isinstance(spec, dict) else ""
        held = self._replicas.get(use)
        if held is None or held[0] != key or held[1].backend is not be:
            try:
                held = self._replicas[use] = key, build(spec, be, 1)
            except (ValueError, TypeError, AttributeError):
                return None
        return held[1]

    def _loaded(self, task: Message, reply: Message, part: Network) -> int:
        """``part`` (the replica, or its conv part) with the task's weights and, as its running statistics, the
        worker's batch statistics, for an evaluation forward; the roundings that adds (``slice_statistics``)."""
        flat.unpack(part, task.arrays["params"])
        return one_image.slice_statistics(part, reply.arrays.get("stats"), task.arrays["x"].shape)

    def _replay(self, k: int, got: list[tuple[Message, Message]], be: Backend) -> None:
        """Run the worker's own handler on the tasks it got, and judge every array of its answers."""
        t0 = clock()
        if self.local is None:
            self.local = Worker(be)
        pairs = [(mine, theirs) for sent, theirs in got for mine in [self.local.handle(sent)]]
        dt = self._replay_s = clock() - t0
        self.credit[k] = self.credit.get(k, 0.0) - dt
        self.seconds += dt
        self.samples += 1
        first = got[0][0]
        self._replayed = [self._replayed[0] + dt, self._replayed[1] + first.arrays["x"].shape[0]]
        net = self.local.state.replica[1]
        part = net if first.kind == "replica_step" else conv_part(net)
        forward, backward = roundings(part, first.arrays["x"].shape)
        for mine, theirs in pairs:
            if mine.kind != "result":  # the master's replay failed where the worker did not: no verdict
                return
            for name, ref in mine.arrays.items():
                answer = theirs.arrays.get(name)
                if answer is None or answer.shape != ref.shape:
                    return  # not this file's to judge: the split's shape check loses the worker
                if name in ("probes", "inner"):  # judged each step: the dW they project, one image's backward, dx
                    continue
                parts = _parts(part, name, ref, answer, backward if name == "grads" else forward)
                if name == "grads" and worst(parts) is not None:  # beyond the scale form: the rigorous one
                    t0 = clock()
                    parts = _parts(part, name, ref, answer, backward, self._magnitudes(got))
                    dt = clock() - t0
                    self.credit[k], self.seconds = self.credit[k] - dt, self.seconds + dt
                    self.forgiven += worst(parts) is None
                self._judge(k, first.kind, parts)

    def _magnitudes(self, got: list[tuple[Message, Message]]) -> dict[str, np.ndarray]:
        """Each parameter's A of the replayed task (``magnitudes.of_task``), on a replica of its own on numpy (the
        replay ran it, so it describes one)."""
        return magnitudes.of_task(self._built(got[0][0], self._numpy, "magnitudes"), got)

    def _judge(self, k: int, kind: str, parts: list[tuple[str, Pair]]) -> None:
        """Lose worker ``k`` ("wrong result") at the first entry beyond its tolerance (a scalar or one per entry)."""
        bad = worst(parts)
        if bad is not None:
            (what, (got, ref, tol)), i = bad
            gap = np.abs(got.astype(np.float64) - ref)
            why = f"wrong result: {what} in its {kind} differs from the master's by {gap.flat[i]:.3g}"
            self._lose(k, f"{why} (round-off allows {np.broadcast_to(tol, gap.shape).flat[i]:.3g})")

    def _lose(self, k: int, why: str) -> None:
        for kept in (self.credit, self.image_credit, self.back_credit, self._top, self.forward):
            kept.pop(k, None)
        self._doubted.discard(k)
        self._trails.forget(k)
        raise Lost({k: why}, wrong=True)


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


def _parts(
    net: Network, name: str, ref: np.ndarray, got: np.ndarray, k: int, mags: dict[str, np.ndarray] | None = None
) -> list[tuple[str, Pair]]:
    """(what, (the worker's, the master's, their tolerance)) of an answer's array: a gradient vector split by
    parameter, each on the scale of its layer's largest gradient entry (a convolution's bias before batch norm
    has a gradient of 0 but for round-off: its sums cancel, its weights' do not), or with ``mags`` the rigorous
    form, on its layer's largest magnitude (``magnitudes.py``: where a backward cancels, its round-off is on the
    scale of the terms it subtracts); any other array whole."""
    if name != "grads":
        return [(name, pair(got, ref, k))]
    at = flat.spans(net)
    parts = [(p, layer, ref[at[p]], got[at[p]]) for p, layer, _ in net.named_params()]
    size = {p: max(scale(r), scale(mags[p]) if mags else 0.0) for p, _, r, _ in parts}
    top = {id(layer): max(size[p] for p, other, _, _ in parts if other is layer) for _, layer, _, _ in parts}
    return [(f"the gradient of {p}", pair(g, r, k, top[id(layer)])) for p, layer, r, g in parts]
