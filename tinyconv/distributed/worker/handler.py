"""The worker: answers the master's tasks (``protocol.py``) on one Backend.

:class:`Worker` is the handler every transport serves (``transports.base.Handler``). Each task kind has one
handler in :data:`HANDLERS`, a plain function of the worker's state (``state.py``: what it keeps between tasks,
and which task may follow which): the paper's split by kernels here, by input channels in
``channel_handlers.py``, data parallelism and the hybrid in ``replica_handlers.py``, calibration in
``calibrate.py``. A task the worker cannot run becomes an ``error`` reply naming why. The wire codec
(``wire_codec.py``) widens a task's narrowed arrays as it arrives and narrows its result as it goes, so every
handler computes in float32.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from backends.base import Backend
from tinyconv.distributed.calibrate import calibrate, default_max_calibrate_bytes
from tinyconv.distributed.protocol import NORM_INPUTS, VERSION, TaskError, check_task
from tinyconv.distributed.replica import probe
from tinyconv.distributed.shard.block import block_forward as run_block_forward
from tinyconv.distributed.shard.block import conv_backward, tail_backward
from tinyconv.distributed.wire_codec import decode_task, encode_result, read_back
from tinyconv.distributed.worker import channel_handlers, replica_handlers
from tinyconv.distributed.worker.state import Handler, OpenStep, WorkerState, checked_tail, header_span, norm_arrays
from transports.base import Message, still_computing
from transports.wire import error_reply


def block_forward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], _: None) -> dict[str, Any]:
    """The block (conv and tail) of the F' kernels it got, its cache kept; y of the ``own`` ones."""
    x, w, b = a["x"], a["w"], a["b"]
    if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[1] or tuple(b.shape) != tuple(w.shape[:1]):
        raise TaskError(
            f"layer {h['layer']}: expected x (N, C, H, W), w (F, C, KH, KW) and b (F,) with matching C and F; "
            f"got x {x.shape}, w {w.shape}, b {b.shape}"
        )
    tail = checked_tail(h, x.shape[2:], w.shape[2:])
    own = header_span(h, "own", w.shape[0])
    norm = norm_arrays(tail, a, w.shape[0], f"layer {h['layer']}")
    y, cache = run_block_forward(state.backend, x, w, b, h["stride"], h["padding"], tail, own, norm)
    kept = OpenStep("block", h["step"], cache=cache, probe=(x, h["stride"], h["padding"], tuple(w.shape[1:])))
    state.advance(h, "block_forward", kept)
    return {"y": y} | {k: norm[k] for k in ("mean", "var") if k in norm}  # a training batch norm's statistics


def block_backward(state: WorkerState, h: dict[str, Any], a: dict[str, Any], kept: OpenStep) -> dict[str, Any]:
    """dw, db of its own kernels and a partial dx, from dy over every kernel its forward computed; asked a
    ``probe`` (u, v), the sums s, a of its dw along them (``replica/probe.py``)."""
    be, (lo, hi), (x, stride, padding, ckk) = state.backend, kept.cache.own, kept.probe
    if "probe" in a and a["probe"].shape != (hi - lo + math.prod(ckk),):
        raise TaskError(f"layer {h['layer']}: probe must be u ({hi - lo},), then v {ckk}; got {a['probe'].shape}")
    try:
        d = tail_backward(be, a["dy"], kept.cache)
    except ValueError as e:  # a dy that does not fit the forward, which stays for a good one
        raise TaskError(f"layer {h['layer']} step {h['step']}: {e}") from None
    dx, dw, db = conv_backward(be, d, kept.cache, h["need_dx"])
    state.advance(h, "block_backward", kept)
    dnorm = {"d" + k: v for k, v in kept.cache.dnorm.items()}  # batch norm's dgamma, dbeta
    out = {"dw": dw, "db": db} | ({"dx": dx} if h["need_dx"] else {}) | dnorm
    if "probe" not in a:
        return out
    u, v = a["probe"][: hi - lo], a["probe"][hi - lo :].reshape(ckk)
    s = probe.sums(be.to_numpy(x), be.to_numpy(d)[:, lo:hi], u, v, stride, padding)
    return out | {"probes": np.array(s, np.float32)}


HANDLERS: dict[str, Handler] = {
    "block_forward": block_forward,
    "block_backward": block_backward,
    "calibrate": calibrate,
    **channel_handlers.HANDLERS,
    **replica_handlers.HANDLERS,
}
# task kind -> the inputs its handler only hands to the backend, put there as the task arrives (and maybe
# widened there, wire_codec.py); the others meet numpy arithmetic first, so they stay on the host
ON_BACKEND: dict[str, frozenset[str]] = {
    "block_forward": frozenset({"x", "w", "b", *NORM_INPUTS}),
    "block_backward": frozenset({"dy"}),  # its probe is read on the host
    **channel_handlers.ON_BACKEND,
}


class Worker:
    """Serves the task protocol on ``backend``.

    ``slowdown`` F >= 1 is a testing aid that emulates a slower device: after each task the
    worker waits an extra (F - 1) x its compute time and reports F x that time (calibration
    times included), so a master balances it as slower. ``max_calibrate_bytes`` (default: half
    the machine's memory) refuses to time a layer that would need more.
    """

    def __init__(self, backend: Backend, slowdown: float = 1.0, max_calibrate_bytes: int | None = None) -> None:
        if not (isinstance(slowdown, (int, float)) and math.isfinite(slowdown) and slowdown >= 1):
            raise ValueError(f"slowdown must be a finite number >= 1, got {slowdown!r}")
        max_bytes = default_max_calibrate_bytes() if max_calibrate_bytes is None else max_calibrate_bytes
        self.state = WorkerState(backend, float(slowdown), int(max_bytes))
        backend.progress = lambda: still_computing.get()()  # the backend's long first runs: "started" again
        self._idle = threading.Event()  # never set: waiting on it is how slowdown passes time

    def hello(self) -> dict[str, Any]:
        """The ``hello`` header. A hello starts a session with a (new) master: nothing kept from an earlier one."""
        self.state.forget()
        device = dict(self.state.backend.describe())
        if self.state.slowdown != 1.0:
            device["slowdown"] = self.state.slowdown
        return {
            "protocol": VERSION,
            "backend": self.state.backend.name,
            "device": device,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def handle(self, msg: Message) -> Message:
        """Answer one task with a ``result``, or an ``error`` naming what was wrong with it. A backend
        failure raises, and the transport sends it as an ``error`` (``transports.base.Handler``)."""
        t0 = time.perf_counter()
        be, on_backend = self.state.backend, ON_BACKEND.get(msg.kind, frozenset())
        try:
            task, asked = decode_task(msg, be, on_backend)  # float32 from here on
            check_task(task)
            kept = self.state.expect(task.kind, task.header)
            # an input on the backend: a host array copied there, one the codec widened there as it is
            arrays = {
                k: be.asarray(a) if k in on_backend and isinstance(a, np.ndarray) else a for k, a in task.arrays.items()
            }
            reply = HANDLERS[task.kind](self.state, task.header, arrays, kept)
        except TaskError as e:
            return error_reply(msg, f"{msg.kind}: {e}")
        times = reply.pop("times", None)
        out = {k: read_back(be, a, asked.get(k, "fp32")) for k, a in reply.items()}
        be.synchronize()
        compute_s = time.perf_counter() - t0
        out, narrow = encode_result(out, asked)
        self._idle.wait((self.state.slowdown - 1.0) * compute_s)  # emulating a slower device, not a sync
        header = {"task": task.header["task"], "compute_s": compute_s * self.state.slowdown} | narrow
        return Message("result", header | ({"times": times} if times is not None else {}), out)
