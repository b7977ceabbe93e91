"""The worker's side of the paper's split by kernels (``tinyconv/distributed/shard/by_kernels.py``), and calibration.

``block_forward`` computes the block (conv and tail) of the F' kernels it got and keeps its cache;
``block_backward`` answers with dw, db of its own kernels and a partial dx. ``calibrate`` times
whole layers once, before training (``tinyconv/distributed/calibrate.py``). Each handler is a plain
function of the worker's :class:`~tinyconv.distributed.worker.state.WorkerState`.
"""

from __future__ import annotations

from typing import Any

from backends.base import conv_output_size
from tinyconv.distributed.calibrate import parse_spec, time_block
from tinyconv.distributed.heap import release_freed_memory
from tinyconv.distributed.protocol import TaskError
from tinyconv.distributed.shard.block import block_backward as run_block_backward
from tinyconv.distributed.shard.block import block_forward as run_block_forward
from tinyconv.distributed.shard.block import check_tail, tail_output_hw
from tinyconv.distributed.worker.state import Handler, OpenStep, WorkerState, header_span


def block_forward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """The block (conv and tail) of the F' kernels it got; y of the ``own`` ones."""
    x, w, b = a["x"], a["w"], a["b"]  # on the backend already (handler.py's ON_BACKEND)
    if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[1] or tuple(b.shape) != tuple(w.shape[:1]):
        raise TaskError(
            f"layer {h['layer']}: expected x (N, C, H, W), w (F, C, KH, KW) and b (F,) with matching C and F; "
            f"got x {x.shape}, w {w.shape}, b {b.shape}"
        )
    tail = checked_tail(h, x.shape[2:], w.shape[2:])
    own = header_span(h, "own", w.shape[0])
    y, cache = run_block_forward(state.backend, x, w, b, h["stride"], h["padding"], tail, own)
    state.advance(h, "block_forward", OpenStep("block", h["step"], cache=cache))
    return {"y": y}


def block_backward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], kept: OpenStep) -> dict[str, Any]:
    """dw, db of its own kernels and a partial dx, from dy over every kernel its forward computed."""
    try:
        dx, dw, db = run_block_backward(state.backend, a["dy"], kept.cache, h["need_dx"])
    except ValueError as e:  # a dy that does not fit the forward, which stays for a good one
        raise TaskError(f"layer {h['layer']} step {h['step']}: {e}") from None
    state.advance(h, "block_backward", kept)
    return {"dw": dw, "db": db} | ({"dx": dx} if h["need_dx"] else {})


def calibrate(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """``times``: seconds per layer, each the median of ``repeats`` runs after a warm-up."""
    if not 1 <= h["repeats"] <= 1000:
        raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
    if not h["layers"]:
        raise TaskError("layers is empty: nothing to calibrate")
    specs = [parse_spec(i, spec, state.max_calibrate_bytes) for i, spec in enumerate(h["layers"])]
    times = [time_block(state.backend, spec, h["repeats"]) * state.slowdown for spec in specs]
    release_freed_memory()  # the whole layers' memory, kept, would stay the run's peak (heap.py)
    return {"times": times}


def checked_tail(h: dict[str, Any], size: tuple[int, ...], kernel: tuple[int, ...]) -> list[dict[str, Any]]:
    """The task's tail, checked against the convolution's output size."""
    if h["stride"] < 1 or h["padding"] < 0:
        raise TaskError(f"layer {h['layer']}: need stride >= 1 and padding >= 0, got {h['stride']} and {h['padding']}")
    try:
        oh, ow = (conv_output_size(s, k, h["stride"], h["padding"]) for s, k in zip(size, kernel, strict=True))
        tail_output_hw(oh, ow, check_tail(h["tail"]))
    except ValueError as e:
        raise TaskError(f"layer {h['layer']}: {e}") from None
    return h["tail"]


HANDLERS: dict[str, Handler] = {
    "block_forward": block_forward,
    "block_backward": block_backward,
    "calibrate": calibrate,
}
