"""Spot checks of the splits by images (data parallelism, the hybrid): the master replays a worker's whole task.

Its budget and tolerance: docs/how-it-works.md, "Spot checks".
"""

from __future__ import annotations

import time

import numpy as np

from backends.base import Backend
from backends.conformance.checks import FN, scale
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.conv_part import conv_part
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


class ReplayCheck:
    """Replays every worker's replica tasks within ``budget`` of its work; raises Lost on a wrong one.

    What it did: ``samples`` (tasks replayed), ``seconds`` the master spent on them, ``earned`` the seconds
    the budget allowed. ``local`` is the master's own worker that replays (on the backend of the first call)."""

    def __init__(self, budget: float = 0.03) -> None:
        if not 0 < budget <= 1:
            raise ValueError(f"the spot-check budget is a fraction of each worker's work in (0, 1], got {budget!r}")
        self.budget = budget
        self.credit: dict[int, float] = {}  # worker -> master seconds
        self.forward: dict[int, tuple[Message, Message]] = {}  # worker -> its step's hybrid_forward and answer
        self.samples, self.seconds, self.earned = 0, 0.0, 0.0
        self.master_rate = 0.0  # the master's seconds per image of a whole task, on its own slice
        self._replayed = [0.0, 0]  # seconds, images: the rate until the master measures its own
        self.local: Worker | None = None

    def __call__(self, k: int, task: Message, reply: Message, be: Backend) -> None:
        """Check worker ``k``'s ``reply`` (float32, well formed) to ``task`` on the master's backend ``be``."""
        if task.kind == "hybrid_forward":
            self.forward[k] = (task, reply)
        if task.kind not in ("replica_step", "hybrid_backward") or (
            task.kind == "hybrid_backward" and k not in self.forward
        ):
            return
        first, answer = (task, reply) if task.kind == "replica_step" else self.forward.pop(k)
        images = first.arrays["x"].shape[0]
        rate = self.master_rate or (self._replayed[0] / self._replayed[1] if self._replayed[1] else 0.0)
        earned = self.budget * rate * images
        self.credit[k] = self.credit.get(k, 0.0) + earned
        self.earned += earned
        if self.credit[k] < 0:
            return
        t0 = time.perf_counter()
        if self.local is None:
            self.local = Worker(be)
        got = [(first, answer)] + ([(task, reply)] if task.kind == "hybrid_backward" else [])
        pairs = [(mine, theirs) for sent, theirs in got for mine in [self.local.handle(sent)]]
        dt = time.perf_counter() - t0
        self.credit[k] -= dt
        self.seconds += dt
        self.samples += 1
        self._replayed = [self._replayed[0] + dt, self._replayed[1] + images]
        net = self.local.state.replica[1]
        self._judge(k, first.kind, net if first.kind == "replica_step" else conv_part(net), first, pairs)

    def _judge(self, k: int, kind: str, net: Network, first: Message, pairs: list[tuple[Message, Message]]) -> None:
        """Every array of the worker's answers against the master's replay; a gradient parameter by parameter."""
        forward, backward = roundings(net, first.arrays["x"].shape)
        for mine, theirs in pairs:
            if mine.kind != "result":  # the master's replay failed where the worker did not: no verdict
                return
            for name, ref in mine.arrays.items():
                got = theirs.arrays.get(name)
                if got is None or got.shape != ref.shape:
                    return  # not this file's to judge: the split's shape check loses the worker
                for what, (b, a, tol) in _parts(net, name, ref, got, backward if name == "grads" else forward):
                    err = float(np.max(np.abs(a - b), initial=0.0))
                    if not err <= tol:
                        self.credit.pop(k, None)
                        why = f"wrong result: {what} in its {kind} differs from the master's by {err:.3g}"
                        raise Lost({k: f"{why} (round-off allows {tol:.3g})"}, wrong=True)


def _parts(net: Network, name: str, ref: np.ndarray, got: np.ndarray, k: int) -> list[tuple[str, Pair]]:
    """(what, (the worker's, the master's, their tolerance)) of an answer's array: a gradient vector split by
    parameter, each on the scale of its layer's largest gradient entry (a convolution's bias before batch norm
    has a gradient of 0 but for round-off: its sums cancel, its weights' do not); any other array whole."""
    if name != "grads":
        return [(name, pair(got, ref, k))]
    ends, params = np.cumsum(flat.sizes(net)), [(p, layer) for p, layer, _ in net.named_params()]
    parts = [
        (p, layer, ref[end - n : end], got[end - n : end])
        for (p, layer), n, end in zip(params, flat.sizes(net), ends, strict=True)
    ]
    top = {id(layer): max(scale(r) for _, other, r, _ in parts if other is layer) for _, layer, _, _ in parts}
    return [(f"the gradient of {p}", pair(g, r, k, top[id(layer)])) for p, layer, r, g in parts]
