"""The worker's side of data parallelism and the hybrid (``tinyconv/distributed/replica/``): a whole replica.

Its P parameters (and B batch-norm statistics) travel as one flat vector each (``replica/flat.py``); each task is
checked against its schema first (the tasks, their headers and arrays: docs/how-it-works.md, "The tasks of the other
splits"). Every task but ``hybrid_backward`` brings everything it needs; between them the worker keeps only its
replica (:func:`_replica`), whose layers hold ``hybrid_forward``'s caches under the slot ``state.HYBRID``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tinyconv.distributed.heap import release_freed_memory
from tinyconv.distributed.protocol import TaskError
from tinyconv.distributed.replica import flat, inner_ops, probe
from tinyconv.distributed.replica.conv_part import (
    backward_features,
    conv_part,
    feature_shape,
    forward_features,
    time_conv_part,
)
from tinyconv.distributed.replica.replica import build, slice_gradients, time_replica
from tinyconv.distributed.worker.state import HYBRID, Handler, OpenStep, WorkerState, task_place
from tinyconv.model import Network


def _timed(state: WorkerState, h: dict[str, Any], timer: Callable[..., float]) -> dict[str, Any]:
    """``replica_calibrate``'s and ``hybrid_calibrate``'s ``times``: [seconds of ``timer`` (a forward + backward
    of the replica or its conv part) on the replica ``net`` describes, for ``batch`` random images]."""
    if not 1 <= h["repeats"] <= 1000:
        raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
    if not 1 <= h["batch"] <= 1 << 16:
        raise TaskError(f"batch must be in 1..65536, got {h['batch']}")
    seconds = timer(_replica(state, h["net"], h["batch"]), h["net"], h["batch"], h["repeats"]) * state.slowdown
    release_freed_memory()  # the whole batch's memory, kept, would stay the run's peak (heap.py)
    return {"times": [seconds]}


def replica_step(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """The replica, given the master's weights (and batch-norm statistics), on its slice x, y of a
    batch of ``batch``: the slice's part of the gradient (of the loss label-smoothed by ``smoothing``,
    if the header has it), its logits, its batch norms' batch statistics (``replica.keeping_statistics``)."""
    x, y, smoothing = a["x"], a["y"], h.get("smoothing", 0.0)
    if not 0.0 <= smoothing < 1.0:
        raise TaskError(f"smoothing must be in [0, 1) (label smoothing), got {smoothing}")
    net = _slice_replica(state, h, x, "replica_step")
    if y.shape != x.shape[:1]:
        raise TaskError(f"replica_step takes y ({x.shape[0]},), one label per image, got y {y.shape}")
    buffers = _load(net, a, "replica", "")
    seen = ({}, {}) if _probe(net, a) is not None else None
    try:
        logits = slice_gradients(net, x, y, h["batch"], smoothing, seen)
    except ValueError as e:  # labels out of range
        raise TaskError(str(e)) from None
    out = {"grads": flat.pack(net, "grads"), "logits": logits}
    if seen is not None:
        out |= {"probes": probe.project(net, a["probe"], *seen)} | _inner(net, a["probe"], *seen)
    return out | ({"stats": flat.pack(net, "buffers")} if buffers else {})


def _probe(net: Network, a: dict[str, Any]) -> Any:
    """The task's ``probe`` (``replica/probe.py``), if it has one, of the size ``probe.size(net)`` gives."""
    if "probe" in a and a["probe"].shape != (probe.size(net),):
        want = f"({probe.size(net)},), F + C K K for each convolution and {probe.WHERE}"
        raise TaskError(f"probe must be {want}; got {a['probe'].shape}")
    return a.get("probe")


def _slice_replica(state: WorkerState, h: dict[str, Any], x: Any, kind: str) -> Network:
    """The replica ``h["net"]`` describes, for a slice x (n, C, H, W) of a batch of ``batch`` that fits it."""
    spec, n = h["net"], x.shape[0] if x.ndim == 4 else 0
    if not (x.ndim == 4 and 1 <= n <= h["batch"] <= 1 << 16):
        raise TaskError(f"{kind} takes x (n, C, H, W) with 1 <= n <= batch ({h['batch']}) <= 65536; got x {x.shape}")
    net = _replica(state, spec, n)
    if x.shape[1:] != (spec["in_channels"], spec["image_size"], spec["image_size"]):
        raise TaskError(f"x {x.shape} does not fit the replica's {spec['in_channels']} channels of "
                        f"{spec['image_size']}x{spec['image_size']} pixels")  # fmt: skip
    return net


def _load(net: Network, a: dict[str, Any], what: str, note: str) -> bool:
    """The master's ``params`` (and ``buffers``, which must come exactly when ``net`` has batch-norm
    statistics) into ``net``, ``what`` the replica or its conv part; whether there were buffers."""
    buffers = a.get("buffers")
    if (buffers is None) != (sum(flat.sizes(net, "buffers")) == 0):
        raise TaskError(f"buffers must come exactly when the {what} has batch-norm statistics")
    try:
        flat.unpack(net, a["params"])  # its size checked before anything is set
        if buffers is not None:
            flat.unpack(net, buffers, "buffers")
    except ValueError as e:
        raise TaskError(f"{e}{note}") from None
    return buffers is not None


# ---- the hybrid: the replica's conv part on a slice, the classifier on the master -------------
def hybrid_forward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """The conv part, given the master's conv weights (and statistics), on its slice x of a batch of
    ``batch``: the features (n, F), its batch norms' batch statistics; the caches kept for hybrid_backward."""
    x = a["x"]
    net = _slice_replica(state, h, x, "hybrid_forward")
    conv = conv_part(net)
    buffers = _load(conv, a, "conv part", " (the conv part's, without the classifier)")
    asked = _probe(conv, a)
    seen: dict[str, Any] | None = {} if asked is not None else None
    features = forward_features(conv, x, seen)
    kept = OpenStep("hybrid", h["step"], images=x.shape[0], features=feature_shape(net, h["net"]["image_size"]))
    kept.probe = (asked, seen) if asked is not None else None
    state.advance(h, "hybrid_forward", kept)
    return {"features": features} | ({"stats": flat.pack(conv, "buffers")} if buffers else {})


def hybrid_backward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], kept: OpenStep) -> dict[str, Any]:
    """The conv part's backward from its rows of dL/dfeatures (n, F): the slice's conv gradient."""
    d, want = a["dfeatures"], (kept.images, math.prod(kept.features))
    if d.shape != want:
        raise TaskError(f"{task_place(h)}: dfeatures must be {want} (the slice's images x features of its "
                        f"forward), got {d.shape}")  # fmt: skip
    conv = conv_part(state.replica[1])
    douts: dict[str, Any] | None = {} if kept.probe is not None else None
    backward_features(conv, d, kept.features, douts)
    state.advance(h, "hybrid_backward", kept)
    out = {"grads": flat.pack(conv, "grads")}
    if kept.probe is None:
        return out
    return out | {"probes": probe.project(conv, kept.probe[0], kept.probe[1], douts)} | _inner(conv, *kept.probe, douts)


def _inner(net: Network, asked: np.ndarray, inputs: dict[str, Any], douts: dict[str, Any]) -> dict[str, np.ndarray]:
    """The backward's ops checked inside, beside the probes (``replica/inner_ops.py``), from the forward's ``seen``
    and the backward's; none where nothing is."""
    inner = inner_ops.sums(net, asked[-probe.WHERE :], inputs, douts)
    return {"inner": inner} if inner.size else {}


def _replica(state: WorkerState, spec: Any, batch: int) -> Network:
    """The replica ``spec`` describes: the one kept, or a new one (within this worker's memory limit).
    Whoever asks for it runs it, so the hybrid's kept forward, whose caches it holds, is forgotten."""
    state.open.pop(HYBRID, None)
    key = repr(sorted(spec.items()))
    if state.replica is None or state.replica[0] != key:
        try:
            state.replica = key, build(spec, state.backend, batch, state.max_calibrate_bytes)
        except ValueError as e:
            raise TaskError(f"replica: {e}") from None
    return state.replica[1]


HANDLERS: dict[str, Handler] = {
    "replica_calibrate": lambda state, h, a, _: _timed(state, h, time_replica),
    "replica_step": replica_step,
    "hybrid_calibrate": lambda state, h, a, _: _timed(state, h, time_conv_part),
    "hybrid_forward": hybrid_forward,
    "hybrid_backward": hybrid_backward,
}
