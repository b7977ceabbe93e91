"""The worker: answers the master's tasks (``tinyconv/distributed/protocol.py``) on one Backend.

:class:`Worker` is the handler every transport serves: ``hello()`` and ``handle(msg)``
(``transports.base.Handler``). Each task kind has one small handler, a plain function of the
worker's :class:`~tinyconv.distributed.worker.state.WorkerState` (``state.py``: what a worker keeps
between tasks, and which task may follow which), found in :data:`HANDLERS`: the split by kernels
and calibration in ``block_handlers.py``, the split by input channels in ``channel_handlers.py``,
data parallelism and the hybrid in ``replica_handlers.py``. Any problem becomes an ``error`` reply
naming it, and the worker keeps serving.

The inputs a handler only hands to the backend (:data:`ON_BACKEND`) are put there as the task
arrives, so the handlers read as the computation alone.

At its edges the worker applies the wire codec (``tinyconv/distributed/wire_codec.py``): a layer's task
may bring arrays narrowed (``--wire-precision``), which are checked and widened to float32 as the
task arrives, and ask for its result in narrower words, into which the result is narrowed as it
goes back; every handler computes in float32. A task without them passes as it is.
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
from tinyconv.distributed.protocol import VERSION, TaskError, check_task
from tinyconv.distributed.wire_codec import decode_task, encode_result, read_back
from tinyconv.distributed.worker import block_handlers, channel_handlers, replica_handlers
from tinyconv.distributed.worker.state import Handler, WorkerState
from transports.base import Message
from transports.wire import error_reply

__all__ = [
    "DEFAULT_MAX_CALIBRATE_BYTES",
    "HANDLERS",
    "ON_BACKEND",
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
# therefore be widened there, wire_codec.py); the others (tail_forward's b and sum, partial_backward's dyc_lo and
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
            t0 = time.perf_counter()
            be, on_backend = self.state.backend, ON_BACKEND.get(msg.kind, frozenset())
            task, asked = decode_task(msg, be, on_backend)  # float32 from here on
            check_task(task)
            kept = self.state.expect(task.kind, task.header)
            arrays = {name: _put(be, a) if name in on_backend else a for name, a in task.arrays.items()}
            reply = HANDLERS[task.kind](self.state, task.header, arrays, kept)
            times = reply.pop("times", None)
            out = {name: read_back(be, a, asked.get(name, "fp32")) for name, a in reply.items()}
            be.synchronize()
            header = {"task": task.header["task"], "compute_s": self._emulate(time.perf_counter() - t0)}
            out, narrow = encode_result(out, asked)
            return Message("result", header | narrow | ({"times": times} if times is not None else {}), out)
        except TaskError as e:
            return error_reply(msg, f"{msg.kind}: {e}")
        except Exception as e:  # a backend failure: report it, keep serving
            return error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")

    def _emulate(self, compute_s: float) -> float:
        """Apply the slowdown factor: wait the extra time, return the time to report."""
        slowdown = self.state.slowdown
        if slowdown > 1.0:
            self._idle.wait((slowdown - 1.0) * compute_s)  # emulation of a slower device, not a sync
        return compute_s * slowdown


def _put(backend: Backend, a: Any) -> Any:
    """An input on the backend: a host array copied there, one the codec widened there as it is."""
    return backend.asarray(a) if isinstance(a, np.ndarray) else a
