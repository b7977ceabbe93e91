"""Calibration: time every participant on each sharded layer's exact shape (docs/how-it-works.md).

Every participant times a forward + backward of each sharded block on the same seeded random values, one
participant at a time so that devices sharing a host do not slow each other's benchmark (:func:`time_everyone`);
the master runs the very code the workers run (:func:`time_block`); a worker answers with :func:`calibrate`.
A layer's spec travels in the ``calibrate`` task (``protocol.py``) as plain values::

    {"layer": 1, "x": [N, C, H, W], "w": [F, C, K, K], "stride": 1, "padding": 2, "need_dx": true, "tail": [...]}
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Backend, conv_output_size
from tinyconv.distributed.heap import release_freed_memory
from tinyconv.distributed.protocol import TaskError
from tinyconv.distributed.rpc import Lost, Rpc
from tinyconv.distributed.shard.block import block_backward, block_forward, tail_output_hw
from tinyconv.distributed.worker.state import WorkerState, checked_tail
from transports.base import Message
from transports.wire import Int, Num


@dataclass(frozen=True)
class Spec:
    """One layer to time: its input and weight shapes, and the block around its convolution."""

    layer: int
    x: tuple[int, int, int, int]  # (N, C, H, W)
    w: tuple[int, int, int, int]  # (F, C, K, K)
    stride: int
    padding: int
    need_dx: bool
    tail: list[dict[str, Any]]

    @property
    def y(self) -> tuple[int, int, int, int]:
        """The block's output shape (N, F, OH', OW'), after the tail."""
        n, _, h, w = self.x
        oh, ow = (conv_output_size(s, self.w[2], self.stride, self.padding) for s in (h, w))
        return (n, self.w[0], *tail_output_hw(oh, ow, self.tail))

    def floats(self) -> int:
        """About how many floats timing it holds at once: the im2col columns, C*KH*KW x N*OH*OW,
        next to x, dx, w, y and dy."""
        n, c, h, w = self.x
        f, _, kh, kw = self.w
        oh, ow = (conv_output_size(s, k, self.stride, self.padding) for s, k in ((h, kh), (w, kw)))
        return c * kh * kw * n * oh * ow + 2 * math.prod(self.x) + math.prod(self.w) + 6 * n * f * oh * ow


def parse_spec(i: int, spec: Any, max_bytes: int | None = None) -> Spec:
    """Layer spec ``i`` of a calibrate task, checked; a TaskError naming what is wrong."""
    allowed = {"layer", "x", "w", "stride", "padding", "need_dx", "tail"}
    if not isinstance(spec, dict) or set(spec) != allowed:
        raise TaskError(
            f"layers[{i}] must be a map with layer, x [N,C,H,W], w [F,C,K,K], stride, padding, need_dx, tail; "
            f"got {spec!r:.200}"
        )
    for name in ("x", "w"):
        shape = spec[name]
        if not (isinstance(shape, list) and len(shape) == 4 and all(Int.accepts(s) and s > 0 for s in shape)):
            raise TaskError(f"layers[{i}].{name} must be 4 positive ints, got {shape!r:.100}")
    if not (all(Int.accepts(spec[k]) for k in ("layer", "stride", "padding")) and isinstance(spec["need_dx"], bool)):
        raise TaskError(f"layers[{i}]: layer, stride, padding must be ints and need_dx a bool")
    if spec["x"][1] != spec["w"][1]:
        raise TaskError(f"layers[{i}]: x {spec['x']} and w {spec['w']} need the same C")
    tail = checked_tail(spec, spec["x"][2:], spec["w"][2:])  # stride, padding, and the tail fits the output
    parsed = Spec(**spec | {"x": tuple(spec["x"]), "w": tuple(spec["w"]), "tail": tail})
    if max_bytes is not None and 4 * parsed.floats() > max_bytes:
        raise TaskError(
            f"layers[{i}]: timing x {list(parsed.x)}, w {list(parsed.w)} needs about {4 * parsed.floats()} bytes, "
            f"over this worker's limit of {max_bytes} (half its physical memory): use a smaller batch or "
            f"architecture, or a worker machine with more memory"
        )
    return parsed


def time_block(be: Backend, spec: Spec, repeats: int) -> float:
    """Median seconds of a forward + backward of ``spec``'s block on ``be``, after a warm-up run.

    The values are random but seeded by the layer, the same on every participant: only the device differs."""
    rng = np.random.default_rng(spec.layer)
    x = be.asarray(rng.standard_normal(spec.x, dtype=np.float32))
    w = be.asarray(rng.standard_normal(spec.w, dtype=np.float32) * np.float32(0.1))
    b = be.asarray(rng.standard_normal(spec.w[0], dtype=np.float32))
    dy = be.asarray(rng.standard_normal(spec.y, dtype=np.float32))
    ones, zeros = be.asarray(np.ones(spec.w[0], np.float32)), be.zeros((spec.w[0],))

    def once() -> None:
        norm = {"gamma": ones, "beta": zeros, "running_mean": zeros, "running_var": ones}  # a batch norm's, if any
        _, cache = block_forward(be, x, w, b, spec.stride, spec.padding, spec.tail, None, norm)
        block_backward(be, dy, cache, spec.need_dx)

    return median_seconds(once, be, repeats)


def median_seconds(run: Callable[[], object], be: Backend, repeats: int) -> float:
    """The median of ``repeats`` timed runs of ``run`` on ``be``, after a warm-up (which pays for first-use
    allocations and kernel compilation)."""
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        run()
        be.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def default_max_calibrate_bytes() -> int:
    """Half this machine's physical memory, at least 2 GiB: what one calibration may allocate.

    The cap keeps a master from making a worker allocate without bound, but it must admit what a
    real training step at the same shapes allocates anyway (150:800 at batch 256 needs 2.3 GB to
    time conv2, 500:1500 with its tail at batch 64 about 1.6 GB), so it follows the machine."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: the old fixed cap
        physical = 0
    return max(1 << 31, physical // 2)


def calibrate(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """The worker's handler of ``calibrate``: ``times``, seconds per layer, each the median of ``repeats``
    runs after a warm-up, times the worker's slowdown."""
    if not 1 <= h["repeats"] <= 1000:
        raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
    if not h["layers"]:
        raise TaskError("layers is empty: nothing to calibrate")
    specs = [parse_spec(i, spec, state.max_calibrate_bytes) for i, spec in enumerate(h["layers"])]
    times = [time_block(state.backend, spec, h["repeats"]) * state.slowdown for spec in specs]
    release_freed_memory()  # the whole layers' memory, kept, would stay the run's peak (heap.py)
    return {"times": times}


# How many times slower than the reference a worker may be before its calibration counts as lost:
# a laptop beside a desktop, not a worker that stopped.
SLOWER = 10


def time_everyone(
    rpc: Rpc,
    backend: Backend | None,
    specs: list[dict[str, Any]],
    repeats: int,
    workers: list[int],
    reference: float | None = None,
) -> dict[int | None, list[float]]:
    """Seconds per layer of ``specs`` for each of ``workers`` (by index), one at a time, and first for
    the master (key None) on ``backend`` if it takes part (not None): its time is each worker's
    ``reference`` (else the one given: a participant already timed, one pass of all the layers)."""
    times: dict[int | None, list[float]] = {}
    if backend is not None:
        times[None] = [time_block(backend, parse_spec(i, s), repeats) for i, s in enumerate(specs)]
        reference = sum(times[None])
    task = Message("calibrate", {"layers": specs, "repeats": repeats})
    for k in workers:
        times[k] = worker_times(rpc, k, task, "calibration", len(specs), reference)
    return times


def worker_times(rpc: Rpc, k: int, task: Message, what: str, n: int, reference: float | None) -> list[float]:
    """Worker k's answer to a calibration ``task`` (``what`` in errors): ``n`` seconds > 0, within
    :func:`calibration_timeout`."""
    op = rpc.op(what, None, timeout=calibration_timeout(rpc, task, reference))
    return checked_times(k, op.gather([op.send(k, Message(task.kind, dict(task.header)))])[k], task.kind, n)


def calibration_timeout(rpc: Rpc, task: Message, reference: float | None) -> float:
    """The Rpc's timeout or, if longer, SLOWER times the 1 + repeats runs of ``task`` would take at
    ``reference`` seconds a run, so that a large network at a large batch is not taken for a lost
    worker (conv2 of 300:1000 at batch 256 takes ~40 s a pass on one core)."""
    return rpc.timeout if reference is None else max(rpc.timeout, SLOWER * (1 + task.header["repeats"]) * reference)


def checked_times(k: int, reply: Message, kind: str, n: int) -> list[float]:
    """The ``n`` seconds > 0 of worker k's ``reply`` to a calibration of ``kind``, or Lost saying what came."""
    got = reply.header.get("message") if reply.kind == "error" else reply.header.get("times")
    if reply.kind == "error":
        raise Lost({k: f"failed its {kind}: {got}"})
    if not (
        isinstance(got, list) and len(got) == n and all(Num.accepts(t) and math.isfinite(t) and t > 0 for t in got)
    ):
        why = f"answered {kind} with times {got!r:.200}, expected {n} positive seconds (same tinyconv version?)"
        raise Lost({k: why}, wrong=True)
    return [float(t) for t in got]
