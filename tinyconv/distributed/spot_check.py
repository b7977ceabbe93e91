"""Spot checks: the master recomputes a sample of every worker's results and loses a worker whose numbers are wrong.

Each split is sampled through a *view* of one worker's tasks of one layer's step (``spot_views.py``). The samples,
the budget and the round-off each is held to: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import Backend
from tinyconv.distributed.replica import probe
from tinyconv.distributed.rpc import Lost
from tinyconv.distributed.spot_sample import Pair, Sample, clock, worst
from tinyconv.distributed.spot_views import ByChannels, ByKernels
from transports.base import Message

# of the budget, each kind's spare beyond a step's share going to the next: the checks of every step (the floor
# whatever the credit, each dW's projection while they are paid for); by input channels one place of P and of dx;
# image samples, cheap (1/N of a task), the forward and dx; kernel samples, dw and db
SHARES = {"every": 1 / 2, "place": 1 / 4, "image": 1 / 6, "kernel": 1 / 12}
# the checks of every step keep in hand HAND times what they cost the last step, where that is more than a step's
# share: at 16:32 they cost about their share, and one dear step would otherwise cost the next its projection
HAND = 4

# the tasks it samples: by kernels (block.py), by input channels (by_channels.py)
TASKS = ("block_forward", "block_backward", "partial_forward", "tail_forward", "tail_backward", "partial_backward")


@dataclass
class _Worker:
    credit: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> kind -> master seconds
    views: dict[int, Any] = field(default_factory=dict)  # layer -> a view of its tasks of the step under way
    samples: dict[int, list[Sample]] = field(default_factory=dict)  # layer -> that forward's, for its backward
    place_after_backward: set[int] = field(default_factory=set)  # layers whose place this step is the backward's
    backward_next: set[int] = field(default_factory=set)  # layers whose next paid place is the backward's
    every: dict[int, float] = field(default_factory=dict)  # layer -> its checks of every step's seconds, this step


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
        self.free_seconds = 0.0  # of the seconds, those of the checks of every step (the floors, the projections)
        self._top: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (worker, layer) -> its next probe
        self._trails = probe.Trails()  # (worker, layer) -> its projections' last rows

    def ask(self, k: int, task: Message) -> dict[str, np.ndarray]:
        """What goes with worker k's ``task``: with its layer's backward, the probe of its dW (``replica/probe.py``),
        u and v of the top singular pair of the last one it sent, if it owns as many kernels; none else."""
        if task.kind not in ("block_backward", "partial_backward"):
            return {}
        layer, state = task.header.get("layer"), self.workers.get(k, _Worker())
        view, top = state.views.get(layer), self._top.get((k, layer))
        if view is None or top is None or view.step != task.header.get("step") or not self._paid(state, layer):
            return {}
        return {"probe": np.concatenate([top[0], top[1]])} if view.asks(task) == (len(top[0]), len(top[1])) else {}

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
            self._projected(k, layer, view)
            self._backward(k, state, layer, be)

    def _projected(self, k: int, layer: int, view: Any) -> None:
        """Every step: the dW worker k sent against the sums along the probe it sent beside it (``replica/probe.py``),
        alone and summed over its last steps; its next probe from this dW, while they are paid for."""
        state, t0 = self.workers[k], clock()
        dw, sent, got, n = view.projection()
        key, what = (k, layer), f"its backward, the gradient of layer {layer}'s w against its projection"
        if sent is not None and (got is None or got.shape != (2,)):
            self._lose(
                k, f"wrong result: asked for its dw's projection, it sent {'none' if got is None else got.shape}"
            )
        if sent is not None:
            one, row = probe.compared(dw, sent[: len(dw)], sent[len(dw) :], float(got[0]), float(got[1]), n)
            alone = [] if abs(row[0] - row[1]) <= one[2] else [(what, one)]  # an optimisation: most steps, no arrays
            for where, p in alone + self._trails(key, [what], [row]):
                self._judge(k, where, [p])
        self._spend(state, "every", t0, 0, layer)
        last = self._top.get(key)
        last = last if last is not None and len(last[0]) == len(dw) else None
        if last is None or self._paid(state, layer):  # one power iteration a step: the gradient turns slowly
            t0 = clock()
            self._top[key] = probe.top_pair(dw, last, steps=1)
            self._spend(state, "every", t0, 0, layer)
        if layer in state.place_after_backward:
            state.place_after_backward.discard(layer)
            self._at_one_place(k, state, layer, "backward")

    def _at_one_place(self, k: int, state: _Worker, layer: int, after: str) -> None:
        """One place of the results after the ``forward`` or the ``backward`` (``ByChannels.at_one_place``), while
        its credit is not negative; the forward's and the backward's take turns, decided at the forward (both would
        spend the credit on the forward's; a coin can leave dx unchecked for 10 steps at 16:32)."""
        if after == "forward" and state.credit[layer]["place"] < 0 and self._rate(layer):
            return
        if after == "forward" and layer in state.backward_next:
            state.backward_next.discard(layer)
            state.place_after_backward.add(layer)
            return
        if after == "forward":
            state.backward_next.add(layer)
        t0 = clock()
        for where, p in state.views[layer].at_one_place(after, self.rng):
            self._judge(k, f"its {after}, {where}", [p])
        self._spend(state, "place", t0, 0, layer)

    def _rate(self, layer: int) -> float:
        """The master's seconds per kernel-channel-image of ``layer``: as the cluster timed its share, or its image
        samples so far (0: none yet)."""
        spent, cells = self._image.get(layer, (0.0, 0.0))
        return self.master_rate.get(layer) or (spent / cells if cells else 0.0)

    def _paid(self, state: _Worker, layer: int) -> bool:
        """Whether the checks of every step are paid for on ``layer`` (none before a sample prices the budget)."""
        return state.credit.get(layer, {}).get("every", 0.0) >= 0 or not self._rate(layer)

    def _place(self, view: Any, kind: str, besides: list[int], among: range | None = None) -> int | None:
        choices = [i for i in (view.places(kind) if among is None else among) if i not in besides]
        return int(self.rng.choice(choices)) if choices else None

    def _spend(self, state: _Worker, kind: str, t0: float, cells: float, layer: int) -> None:
        """Take a check's seconds since ``t0`` off its kind's credit (``cells``: an image's kernel-channel-images)."""
        dt = clock() - t0
        state.credit[layer][kind] -= dt
        self.seconds += dt
        if kind == "every":
            self.free_seconds += dt
            state.every[layer] = state.every.get(layer, 0.0) + dt
        if kind == "image":
            spent = self._image.setdefault(layer, [0.0, 0.0])
            spent[0] += dt
            spent[1] += cells

    def _forward(self, k: int, state: _Worker, layer: int, be: Backend) -> None:
        view, rate = state.views[layer], self._rate(layer)
        credit = state.credit.setdefault(layer, dict.fromkeys(SHARES, 0.0))
        step = self.budget * 3 * view.work * rate  # this step's credit, in master seconds
        for kind, share in SHARES.items():
            credit[kind] += share * step
            self.earned += share * step
        last, t0 = state.every.pop(layer, 0.0), clock()  # what the checks of every step cost the last step
        for where, low in view.floor():
            if not low >= 0:
                self._lose(k, f"wrong result: {where}, is {low:.3g}")
        self._spend(state, "every", t0, 0, layer)
        for kind, was in (("place", "every"), ("image", "place"), ("kernel", "image")):
            hand = max(SHARES[was] * step, HAND * last if was == "every" else 0.0)
            if (spare := credit[was] - hand) > 0:  # what a kind leaves beyond a step's share (or its hand)
                credit[kind], credit[was] = credit[kind] + spare, credit[was] - spare
            if kind == "place":
                self._at_one_place(k, state, layer, "forward")
                continue
            if (credit[kind] < 0 and rate) or (at := self._place(view, kind, [])) is None:  # unpriced: one runs
                continue
            t0 = clock()
            sample = view.sample(kind, at, be)
            self.samples += 1
            self._judge(k, f"its forward, in {kind} {at}", view.forward_pairs(sample, be))
            self._spend(state, kind, t0, view.work / view.images, layer)
            state.samples[layer].append(sample)

    def _backward(self, k: int, state: _Worker, layer: int, be: Backend) -> None:
        view = state.views.pop(layer)
        for sample in state.samples.pop(layer):
            t0 = clock()
            pairs = view.backward_pairs(sample, be)
            agree, seen = _agree(pairs), [sample.at]
            alike = view.alike(sample)  # where a confirming sample checks the same numbers
            while not agree and len(seen) < 3 and (at := self._place(view, sample.kind, seen, alike)) is not None:
                agree = _agree(view.backward_pairs(view.sample(sample.kind, at, be), be))
                self.forgiven += agree  # round-off flipped a tie in the first sample, not a wrong worker
                seen.append(at)
            if not agree:
                self._judge(k, f"its backward, in {sample.kind} {sample.at}", pairs)
            self._spend(state, sample.kind, t0, 2 * view.work / view.images, layer)

    def _judge(self, k: int, where: str, pairs: list[Pair]) -> None:
        bad = worst([(where, p) for p in pairs])
        if bad is not None:
            (_, (got, ref, tol)), i = bad
            gap = np.abs(got.astype(np.float64) - ref)
            allowed = np.broadcast_to(tol, gap.shape).flat[i]
            why = f"wrong result: {where} differs from the master's by {gap.flat[i]:.3g}"
            self._lose(k, f"{why} (round-off allows {allowed:.3g})")

    def _lose(self, k: int, why: str) -> None:
        self.workers.pop(k, None)
        self._trails.forget(k)
        for key in [key for key in self._top if key[0] == k]:
            del self._top[key]
        raise Lost({k: why}, wrong=True)


def _agree(pairs: list[Pair]) -> bool:
    return all(np.all(np.abs(got - ref) <= tol) for got, ref, tol in pairs)
