"""The worker: answers the master's tasks (``tinyconv/dist/protocol.py``) on one Backend.

:class:`Worker` is the handler every transport serves: ``hello()`` and ``handle(msg)``
(``transports.base.Handler``). Each task kind has one small handler, a plain function of the
worker's :class:`~tinyconv.dist.worker.state.WorkerState` (``state.py``: what a worker keeps
between tasks, and which task may follow which), found in :data:`HANDLERS`: the split by kernels
and calibration in ``block_handlers.py``, the split by input channels in ``channel_handlers.py``,
data parallelism and the hybrid in ``replica_handlers.py``. Any problem becomes an ``error`` reply
naming it, and the worker keeps serving.

The inputs a handler only hands to the backend (:data:`ON_BACKEND`) are put there as the task
arrives, so the handlers read as the computation alone.

A layer's task may bring arrays narrowed (``tinyconv/dist/wire_precision.py``): once the task is
checked they are widened to float32, every handler computes in float32, and the result's arrays
are narrowed to the formats the task's ``reply`` asks for right before they go back. Where the
backend converts on its device (``Backend.narrow_wire`` / ``widen_wire``: OpenCL's bf16), a result
still on the device is narrowed there and only its narrow words are read back, and an input of
:data:`ON_BACKEND` is widened there after only its narrow words were written: the same words on
the wire either way.
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
from tinyconv.dist.protocol import VERSION, TaskError, check_task, narrowed, widened
from tinyconv.dist.wire_precision import Narrowed, declare
from tinyconv.dist.worker import block_handlers, channel_handlers, replica_handlers
from tinyconv.dist.worker.state import STAGES, STANDALONE, Handler, WorkerState
from transports.base import Message
from transports.wire import error_reply

__all__ = [
    "DEFAULT_MAX_CALIBRATE_BYTES",
    "HANDLERS",
    "ON_BACKEND",
    "STAGES",
    "STANDALONE",
    "Worker",
    "default_max_calibrate_bytes",
]


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


DEFAULT_MAX_CALIBRATE_BYTES = default_max_calibrate_bytes()

# task kind -> its handler
HANDLERS: dict[str, Handler] = block_handlers.HANDLERS | channel_handlers.HANDLERS | replica_handlers.HANDLERS
# task kind -> the inputs its handler only hands to the backend, which are put there on arrival (and may
# therefore be widened on the device); the others (tail_forward's b and sum, partial_backward's dyc_lo and
# dyc_hi) meet numpy arithmetic first, so they stay on the host
ON_BACKEND: dict[str, frozenset[str]] = {
    "block_forward": frozenset({"x", "w", "b"}),
    "block_backward": frozenset({"dy"}),
    "partial_forward": frozenset({"x", "w"}),
    "tail_backward": frozenset({"dy"}),
}


class Worker:
    """Serves the task protocol on ``backend``.

    ``slowdown`` F >= 1 is a testing aid that emulates a slower device: after each task the
    worker waits an extra (F - 1) x its compute time and reports F x that time (calibration
    times included), so a master balances it as slower. ``max_calibrate_bytes`` refuses to
    time a layer that would need more memory.
    """

    def __init__(
        self, backend: Backend, slowdown: float = 1.0, max_calibrate_bytes: int = DEFAULT_MAX_CALIBRATE_BYTES
    ) -> None:
        if not (isinstance(slowdown, (int, float)) and math.isfinite(slowdown) and slowdown >= 1):
            raise ValueError(f"slowdown must be a finite number >= 1, got {slowdown!r}")
        self.state = WorkerState(backend, float(slowdown), int(max_calibrate_bytes))
        self._idle = threading.Event()  # never set: waiting on it is how slowdown passes time

    def hello(self) -> dict[str, Any]:
        """The ``hello`` header: protocol version, backend, device facts, pid, hostname. A hello
        starts a session with a (new) master: nothing kept from an earlier one."""
        self.state.forget()
        backend = self.state.backend
        device = dict(backend.describe())
        if self.state.slowdown != 1.0:
            device["slowdown"] = self.state.slowdown
        return {
            "protocol": VERSION,
            "backend": backend.name,
            "device": device,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def handle(self, msg: Message) -> Message:
        """Answer one task with a ``result``, or an ``error`` naming what was wrong. Never raises."""
        try:
            check_task(msg)
            kept = self.state.expect(msg.kind, msg.header)
            t0 = time.perf_counter()
            arrays = self._arrive(msg)
            reply = HANDLERS[msg.kind](self.state, msg.header, arrays, kept)
            times = reply.pop("times", None)
            formats = msg.header.get("reply", {})
            arrays = {name: self._read_back(a, formats.get(name, "fp32")) for name, a in reply.items()}
            self.state.backend.synchronize()
            header = {"task": msg.header["task"], "compute_s": self._emulate(time.perf_counter() - t0)}
            if "reply" in msg.header:  # the formats the master asked for; an overflow goes back float32
                arrays, narrow, _ = narrowed(arrays, msg.header["reply"])
                header |= {"narrow": narrow} if narrow else {}
            return Message("result", header | ({"times": times} if times is not None else {}), arrays)
        except TaskError as e:
            return error_reply(msg, f"{msg.kind}: {e}")
        except Exception as e:  # a backend failure: report it, keep serving
            return error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")

    # ---- wire words on the device, where the backend converts them there -----------------------
    def _arrive(self, msg: Message) -> dict[str, Any]:
        """The task's arrays float32 (widened, if they came narrowed), those of :data:`ON_BACKEND` on the
        backend: widened there if the backend does their format, else copied there."""
        names, be = ON_BACKEND.get(msg.kind, frozenset()), self.state.backend

        def widen(name: str, carried: np.ndarray, declared: Any) -> Any:
            if name not in names or not isinstance(declared, str):  # s8's declaration is a list: host
                return None
            return be.widen_wire(carried, declared)

        arrays = widened(msg, widen)
        return {name: be.asarray(a) if name in names and isinstance(a, np.ndarray) else a for name, a in arrays.items()}

    def _read_back(self, a: Any, fmt: str) -> np.ndarray | Narrowed:
        """A result array on the host: narrowed on the device if the backend does ``fmt`` there and
        nothing became infinite (then the host's ``narrowed`` falls back to float32 from all of it)."""
        be = self.state.backend
        if fmt != "fp32" and not isinstance(a, np.ndarray):
            got = be.narrow_wire(a, fmt)
            if got is not None and not got[1]:
                return Narrowed(got[0], fmt, False, declare(fmt, tuple(a.shape)))
        return np.ascontiguousarray(be.to_numpy(a))

    def _emulate(self, compute_s: float) -> float:
        """Apply the slowdown factor: wait the extra time, return the time to report."""
        slowdown = self.state.slowdown
        if slowdown > 1.0:
            self._idle.wait((slowdown - 1.0) * compute_s)  # emulation of a slower device, not a sync
        return compute_s * slowdown
