"""The worker: answers the master's tasks (``tinyconv/dist/protocol.py``) on one Backend.

:class:`Worker` is the handler every transport serves: ``hello()`` and ``handle(msg)``
(``transports.base.Handler``). Each task kind has one small handler, a method of ``Worker``:
the split by kernels and calibration are below; the split by input channels is in
``tinyconv/dist/worker/channel_handlers.py``, data parallelism and the hybrid in ``tinyconv/dist/worker/replica_handlers.py``,
and :class:`Kept`, what a layer's forward leaves for the rest of its step, in ``kept.py``. Any
problem becomes an ``error`` reply naming it, and the worker keeps serving.

Between the tasks of one layer's step a worker keeps what its forward computed. Which
task may come next is explicit, one row per task kind (:data:`STAGES`)::

    task              the layer must be at     it leaves the layer at
    block_forward     anything                 "block"    the block's cache       (split by kernels)
    block_backward    "block"                  nothing
    partial_forward   anything                 "partial"  its partial convolution (split by input channels)
    tail_forward      "partial"                "tail"     the tail's cache
    tail_backward     "tail"                   "dyc"      its kernels' conv-output gradient
    partial_backward  "dyc"                    nothing
    hybrid_forward    anything                 "hybrid"   the conv part's caches  (the hybrid: one slot,
    hybrid_backward   "hybrid"                 nothing                             the whole conv part)

A task that continues a layer must also be of the step its forward was. A refused task
changes nothing, so the right one can follow.

A layer's task may bring arrays narrowed (``tinyconv/dist/wire_precision.py``): once the task is
checked they are widened to float32, every handler computes in float32, and the result's arrays
are narrowed to the formats the task's ``reply`` asks for right before they go back. Where the
backend converts on its device (``Backend.narrow_wire`` / ``widen_wire``: OpenCL's bf16), a result
still on the device is narrowed there and only its narrow words are read back, and an input that
goes straight to the backend (:data:`ON_DEVICE`) is widened there after only its narrow words
were written: the same words on the wire either way.

The data-parallel tasks (``replica_calibrate``, ``replica_step``; ``tinyconv/dist/replica/``; here
``replica.py``) stand alone: each brings everything it needs (the weights with every step), and
the worker keeps only its replica of the network between them, rebuilt when the master describes
another one.

The hybrid's tasks (``hybrid_forward``, ``hybrid_backward``; ``tinyconv/dist/replica/hybrid.py``; here
``replica.py``) run the conv part of that same replica: its forward's caches live in the
replica's layers, kept under the slot ``"conv part"`` (not a layer index) for the step's backward.
Any other replica task runs the replica too and would overwrite those caches, so it forgets that
slot first: a ``hybrid_backward`` after it is refused (send ``hybrid_forward`` again) instead of
computing a wrong gradient. ``hybrid_calibrate`` stands alone, as ``replica_calibrate``.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from backends.base import Backend, conv_output_size
from tinyconv.dist.heap import release_freed_memory
from tinyconv.model import Network
from tinyconv.dist.shard.block import block_backward, block_forward, check_tail, tail_output_hw
from tinyconv.dist.calibrate import parse_spec, time_block
from tinyconv.dist.protocol import VERSION, TaskError, check_task, narrowed, widened
from tinyconv.dist.wire_precision import Narrowed, declare
from tinyconv.dist.worker import channel_handlers as by_channels, replica_handlers as replica
from tinyconv.dist.worker.kept import HYBRID, Kept, header_span, task_place, task_slot
from transports.base import Message
from transports.wire import error_reply

# HYBRID and Kept live in kept.py and are still importable from here
__all__ = [
    "DEFAULT_MAX_CALIBRATE_BYTES",
    "HYBRID",
    "ON_DEVICE",
    "STAGES",
    "STANDALONE",
    "Kept",
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

# task kind -> (the stage the layer must be at, None: anything; the stage it leaves, None: nothing kept)
STAGES: dict[str, tuple[str | None, str | None]] = {
    "block_forward": (None, "block"),
    "block_backward": ("block", None),
    "partial_forward": (None, "partial"),
    "tail_forward": ("partial", "tail"),
    "tail_backward": ("tail", "dyc"),
    "partial_backward": ("dyc", None),
    "hybrid_forward": (None, "hybrid"),
    "hybrid_backward": ("hybrid", None),
}
# the tasks that continue no layer and leave none: each brings all it needs
STANDALONE = frozenset({"calibrate", "replica_calibrate", "replica_step", "hybrid_calibrate"})
_LEFT_BY = {leaves: kind for kind, (_, leaves) in STAGES.items() if leaves}
# task kind -> the inputs its handler only hands to the backend (``_on_backend``), which may therefore
# be widened on the device; the others (tail_forward's b and sum, partial_backward's dyc_lo and dyc_hi)
# meet numpy arithmetic first, so they are widened on the host
ON_DEVICE: dict[str, frozenset[str]] = {
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
        self.backend = backend
        self.slowdown = float(slowdown)
        self.max_calibrate_bytes = int(max_calibrate_bytes)
        self.layers: dict[int | str, Kept] = {}  # layer index (or HYBRID) -> what its last forward left
        self.replica: tuple[str, Network] | None = None  # data parallelism: (its description, the network)
        self._idle = threading.Event()  # never set: waiting on it is how slowdown passes time
        self._handlers: dict[str, Callable[..., dict[str, Any]]] = {
            "calibrate": self.calibrate,
            "block_forward": self.block_forward,
            "block_backward": self.block_backward,
            "partial_forward": self.partial_forward,
            "tail_forward": self.tail_forward,
            "tail_backward": self.tail_backward,
            "partial_backward": self.partial_backward,
            "replica_calibrate": self.replica_calibrate,
            "replica_step": self.replica_step,
            "hybrid_calibrate": self.hybrid_calibrate,
            "hybrid_forward": self.hybrid_forward,
            "hybrid_backward": self.hybrid_backward,
        }

    def hello(self) -> dict[str, Any]:
        """The ``hello`` header: protocol version, backend, device facts, pid, hostname. A hello
        starts a session with a (new) master: nothing kept from an earlier one."""
        self.layers.clear()
        self.replica = None
        device = dict(self.backend.describe())
        if self.slowdown != 1.0:
            device["slowdown"] = self.slowdown
        return {
            "protocol": VERSION,
            "backend": self.backend.name,
            "device": device,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def handle(self, msg: Message) -> Message:
        """Answer one task with a ``result``, or an ``error`` naming what was wrong. Never raises."""
        try:
            check_task(msg)
            kept = self._expect(msg)
            t0 = time.perf_counter()
            reply = self._handlers[msg.kind](msg.header, widened(msg, self._widen_on_device(msg.kind)), kept)
            times = reply.pop("times", None)
            formats = msg.header.get("reply", {})
            arrays = {name: self._read_back(a, formats.get(name, "fp32")) for name, a in reply.items()}
            self.backend.synchronize()
            header = {"task": msg.header["task"], "compute_s": self._emulate(time.perf_counter() - t0)}
            if "reply" in msg.header:  # the formats the master asked for; an overflow goes back float32
                arrays, narrow, _ = narrowed(arrays, msg.header["reply"])
                header |= {"narrow": narrow} if narrow else {}
            return Message("result", header | ({"times": times} if times is not None else {}), arrays)
        except TaskError as e:
            return error_reply(msg, f"{msg.kind}: {e}")
        except Exception as e:  # a backend failure: report it, keep serving
            return error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")

    def _expect(self, msg: Message) -> Kept | None:
        """The layer's kept forward, if this task continues one; a TaskError if it cannot."""
        if msg.kind not in STAGES or STAGES[msg.kind][0] is None:
            return None
        h = msg.header
        where, needs = task_place(h), STAGES[msg.kind][0]
        kept = self.layers.get(task_slot(h))
        if kept is None:
            raise TaskError(
                f"{where}: nothing kept of this layer's forward: send {_LEFT_BY[needs]} first "
                "(or again, if this worker was restarted)"
            )
        if kept.step != h["step"]:
            whose = "this layer's" if isinstance(task_slot(h), int) else "the conv part's"
            raise TaskError(f"{where}: {whose} kept forward is of step {kept.step}")
        if kept.stage != needs:
            raise TaskError(
                f"{where}: {msg.kind} follows {_LEFT_BY[needs]}, but this layer's last task was {_LEFT_BY[kept.stage]}"
            )
        return kept

    def _advance(self, h: dict[str, Any], kind: str, kept: Kept | None) -> None:
        """The layer moves on to the stage ``kind`` leaves it at (forgotten at the end of its step)."""
        leaves = STAGES[kind][1]
        if leaves is None:
            del self.layers[task_slot(h)]  # one backward per forward; frees what it kept
        else:
            kept.stage = leaves
            self.layers[task_slot(h)] = kept

    # ---- split by kernels ---------------------------------------------------------------------
    def block_forward(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """The block (conv and tail) of the F' kernels it got; y of the ``own`` ones."""
        x, w, b = a["x"], a["w"], a["b"]
        if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[1] or b.shape != w.shape[:1]:
            raise TaskError(
                f"layer {h['layer']}: expected x (N, C, H, W), w (F, C, KH, KW) and b (F,) with matching C and F; "
                f"got x {x.shape}, w {w.shape}, b {b.shape}"
            )
        tail = self._tail(h, x.shape[2:], w.shape[2:])
        own = header_span(h, "own", w.shape[0])
        be = self.backend
        put = self._on_backend
        y, cache = block_forward(be, put(x), put(w), put(b), h["stride"], h["padding"], tail, own)
        self._advance(h, "block_forward", Kept("block", h["step"], cache=cache))
        return {"y": y}

    def block_backward(self, h: dict[str, Any], a: dict[str, np.ndarray], kept: Kept) -> dict[str, Any]:
        """dw, db of its own kernels and a partial dx, from dy over every kernel its forward computed."""
        be = self.backend
        try:
            dx, dw, db = block_backward(be, self._on_backend(a["dy"]), kept.cache, h["need_dx"])
        except ValueError as e:  # a dy that does not fit the forward, which stays for a good one
            raise TaskError(f"layer {h['layer']} step {h['step']}: {e}") from None
        self._advance(h, "block_backward", kept)
        return {"dw": dw, "db": db} | ({"dx": dx} if h["need_dx"] else {})

    # ---- split by input channels, data parallelism, the hybrid: plain functions of the worker, ------
    # bound here as methods, so that a subclass may override one (tests poison a worker's results)
    partial_forward = by_channels.partial_forward
    tail_forward = by_channels.tail_forward
    tail_backward = by_channels.tail_backward
    partial_backward = by_channels.partial_backward
    replica_calibrate = replica.replica_calibrate
    replica_step = replica.replica_step
    hybrid_calibrate = replica.hybrid_calibrate
    hybrid_forward = replica.hybrid_forward
    hybrid_backward = replica.hybrid_backward

    # ---- calibration -------------------------------------------------------------------------
    def calibrate(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """``times``: seconds per layer, each the median of ``repeats`` runs after a warm-up."""
        if not 1 <= h["repeats"] <= 1000:
            raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
        if not h["layers"]:
            raise TaskError("layers is empty: nothing to calibrate")
        specs = [parse_spec(i, spec, self.max_calibrate_bytes) for i, spec in enumerate(h["layers"])]
        times = [time_block(self.backend, spec, h["repeats"]) * self.slowdown for spec in specs]
        release_freed_memory()  # the whole layers' memory, kept, would stay the run's peak (heap.py)
        return {"times": times}

    # ---- wire words on the device, where the backend converts them there -----------------------
    def _widen_on_device(self, kind: str) -> Callable[[str, np.ndarray, Any], Any]:
        """For ``protocol.widened``: an input of :data:`ON_DEVICE` widened by the backend, if it does."""
        names = ON_DEVICE.get(kind, frozenset())

        def widen(name: str, carried: np.ndarray, declared: Any) -> Any:
            if name not in names or not isinstance(declared, str):  # s8's declaration is a list: host
                return None
            return self.backend.widen_wire(carried, declared)

        return widen

    def _read_back(self, a: Any, fmt: str) -> np.ndarray | Narrowed:
        """A result array on the host: narrowed on the device if the backend does ``fmt`` there and
        nothing became infinite (then the host's ``narrowed`` falls back to float32 from all of it)."""
        if fmt != "fp32" and not isinstance(a, np.ndarray):
            got = self.backend.narrow_wire(a, fmt)
            if got is not None and not got[1]:
                return Narrowed(got[0], fmt, False, declare(fmt, tuple(a.shape)))
        return np.ascontiguousarray(self.backend.to_numpy(a))

    def _on_backend(self, a: Any) -> Any:
        """An input on the backend: a host array copied there, one widened there (:data:`ON_DEVICE`) as it is."""
        return self.backend.asarray(a) if isinstance(a, np.ndarray) else a

    # ---- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _tail(h: dict[str, Any], size: tuple[int, ...], kernel: tuple[int, ...]) -> list[dict[str, Any]]:
        """The task's tail, checked against the convolution's output size."""
        if h["stride"] < 1 or h["padding"] < 0:
            raise TaskError(
                f"layer {h['layer']}: need stride >= 1 and padding >= 0, got {h['stride']} and {h['padding']}"
            )
        try:
            oh, ow = (conv_output_size(s, k, h["stride"], h["padding"]) for s, k in zip(size, kernel, strict=True))
            tail_output_hw(oh, ow, check_tail(h["tail"]))
        except ValueError as e:
            raise TaskError(f"layer {h['layer']}: {e}") from None
        return h["tail"]

    def _emulate(self, compute_s: float) -> float:
        """Apply the slowdown factor: wait the extra time, return the time to report."""
        if self.slowdown > 1.0:
            self._idle.wait((self.slowdown - 1.0) * compute_s)  # emulation of a slower device, not a sync
        return compute_s * self.slowdown
