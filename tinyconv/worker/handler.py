"""The worker: answers the master's tasks (``tinyconv/shard/protocol.py``) on one Backend.

:class:`Worker` is the handler every transport serves: ``hello()`` and ``handle(msg)``
(``transports.base.Handler``). Each task kind has one small method below. Any problem
becomes an ``error`` reply naming it, and the worker keeps serving.

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

A layer's task may bring arrays narrowed (``tinyconv/shard/wire_precision.py``): once the task is
checked they are widened to float32, every handler computes in float32, and the result's arrays
are narrowed to the formats the task's ``reply`` asks for right before they go back. Where the
backend converts on its device (``Backend.narrow_wire`` / ``widen_wire``: OpenCL's bf16), a result
still on the device is narrowed there and only its narrow words are read back, and an input that
goes straight to the backend (:data:`ON_DEVICE`) is widened there after only its narrow words
were written: the same words on the wire either way.

The data-parallel tasks (``replica_calibrate``, ``replica_step``; ``tinyconv/replica/``) stand
alone: each brings everything it needs (the weights with every step), and the worker keeps only
its replica of the network between them, rebuilt when the master describes another one.

The hybrid's tasks (``hybrid_forward``, ``hybrid_backward``; ``tinyconv/replica/hybrid.py``) run
the conv part of that same replica: its forward's caches live in the replica's layers, kept
under the slot ``"conv part"`` (not a layer index) for the step's backward. Any other replica
task runs the replica too and would overwrite those caches, so it forgets that slot first: a
``hybrid_backward`` after it is refused (send ``hybrid_forward`` again) instead of computing a
wrong gradient. ``hybrid_calibrate`` stands alone, as ``replica_calibrate``.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import Backend, conv_output_size
from tinyconv.model import Network
from tinyconv.replica import flat
from tinyconv.replica.conv_part import backward_features, conv_part, feature_shape, forward_features, time_conv_part
from tinyconv.replica.replica import build, slice_gradients, time_replica
from tinyconv.shard.block import (
    BlockCache,
    block_backward,
    block_forward,
    check_tail,
    owned,
    tail_backward,
    tail_output_hw,
)
from tinyconv.shard.block import tail_forward as run_tail
from tinyconv.shard.calibrate import parse_spec, time_block
from tinyconv.shard.protocol import VERSION, TaskError, check_task, narrowed, widened
from tinyconv.shard.wire_precision import Narrowed, declare
from transports.base import Message
from transports.wire import Int, error_reply


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
HYBRID = "conv part"  # the slot the hybrid's forward is kept in: the whole conv part, not one layer
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


@dataclass
class Kept:
    """What one layer's forward left on this worker for the rest of its step."""

    stage: str
    step: int
    cache: BlockCache | None = None  # "block", "tail", "dyc": the block's (or the tail's) cache
    conv: Any = None  # "partial" on: the backend's cache of the partial convolution
    partial: np.ndarray | None = None  # "partial": the partial convolution on the computed kernels
    tail: list[dict[str, Any]] = field(default_factory=list)
    own: tuple[int, int] = (0, 0)  # the own kernels, as offsets into the computed ones
    dyc: np.ndarray | None = None  # "dyc": the own kernels' conv-output gradient
    kernels: int = 0  # all F kernels of a layer split by input channels
    w: Any = None  # "partial": its weights on the backend, for the chunks after the first
    settings: list[Any] = field(default_factory=list)  # "partial": the first chunk's, which the others repeat
    halo: tuple[int, int] = (0, 0)  # "partial": the computed kernels [cs, ce) of F
    chunks: list[tuple[int, int]] = field(default_factory=list)  # the image ranges of its partial_forwards
    done: int = 0  # images summed by tail_forward; then chunks through partial_backward
    dw: np.ndarray | None = None  # partial_backward's sums over the chunks so far
    db: np.ndarray | None = None
    images: int = 0  # "hybrid": the slice's images
    features: tuple[int, int, int] = (0, 0, 0)  # "hybrid": (C2, H', W') of one image


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
        where, needs = _where(h), STAGES[msg.kind][0]
        kept = self.layers.get(_slot(h))
        if kept is None:
            raise TaskError(
                f"{where}: nothing kept of this layer's forward: send {_LEFT_BY[needs]} first "
                "(or again, if this worker was restarted)"
            )
        if kept.step != h["step"]:
            whose = "this layer's" if isinstance(_slot(h), int) else "the conv part's"
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
            del self.layers[_slot(h)]  # one backward per forward; frees what it kept
        else:
            kept.stage = leaves
            self.layers[_slot(h)] = kept

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
        own = _span(h, "own", w.shape[0])
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

    # ---- split by input channels ------------------------------------------------------------
    # A batch may come in chunks of images (header ``images`` = [a, b, N], ``by_channels.py``'s
    # pipeline): partial_forward chunk by chunk from image 0, w with the first; tail_forward adds the
    # others' sums chunk by chunk and runs the tail with the last (b with it); partial_backward goes
    # by the forward's chunks, in order. Without ``images`` a task is the whole batch, one chunk.
    def partial_forward(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """P, the partial convolution of its input channels for all F kernels, on a chunk of images;
        returns the parts the others need (p_lo = P[:, :lo_end], p_hi = P[:, hi_start:]) and keeps
        P over its halo."""
        x, w = a["x"], a.get("w")
        first, stop, n = _images(h, x.shape[0])
        if x.ndim != 4 or stop - first != x.shape[0] or (w is not None and (w.ndim != 4 or x.shape[1] != w.shape[1])):
            raise TaskError(
                f"layer {h['layer']}: expected x ({stop - first}, c, H, W) for images [{first}, {stop}) and "
                f"w (F, c, KH, KW), got x {x.shape}" + (f", w {w.shape}" if w is not None else "")
            )
        be = self.backend
        settings = [h[key] for key in ("stride", "padding", "tail", "halo", "own", "give")] + [list(x.shape[1:]), n]
        if first == 0:
            if w is None:
                raise TaskError(f"layer {h['layer']}: the first chunk of partial_forward (image 0 on) brings w")
            f = w.shape[0]
            tail = self._tail(h, x.shape[2:], w.shape[2:])
            cs, ce = _span(h, "halo", f)
            own = _span(h, "own", ce - cs)
            give = h["give"]
            if not (isinstance(give, list) and len(give) == 2 and all(Int.accepts(v) and 0 <= v <= f for v in give)):
                raise TaskError(f"layer {h['layer']}: give must be [lo_end, hi_start] within [0, {f}], got {give!r}")
            kept = Kept("partial", h["step"], conv=[], tail=tail, own=own, kernels=f, w=self._on_backend(w))
            kept.settings, kept.halo = settings, (cs, ce)
        else:
            kept = self.layers.get(_slot(h))
            if kept is None or kept.stage != "partial" or kept.step != h["step"] or kept.chunks[-1][1] != first:
                raise TaskError(
                    f"{_where(h)}: partial_forward of images from {first} on continues the chunk that ends there; "
                    "send the batch's chunks in order from image 0"
                )
            if w is not None:
                raise TaskError(f"{_where(h)}: w comes with the first chunk of partial_forward only")
            if settings != kept.settings:
                raise TaskError(f"{_where(h)}: a chunk of partial_forward must repeat its first chunk's settings")
        f, (cs, ce) = kept.kernels, kept.halo
        p, conv = be.conv2d_forward(self._on_backend(x), kept.w, be.zeros((f,)), h["stride"], h["padding"])
        p = be.to_numpy(p)
        if first == 0:
            kept.partial = np.empty((n, ce - cs, *p.shape[2:]), np.float32)
        kept.partial[first:stop] = p[:, cs:ce]
        kept.conv.append(conv)
        kept.chunks.append((first, stop))
        self._advance(h, "partial_forward", kept)
        lo_end, hi_start = h["give"]
        return ({"p_lo": p[:, :lo_end]} if lo_end > 0 else {}) | ({"p_hi": p[:, hi_start:]} if hi_start < f else {})

    def tail_forward(self, h: dict[str, Any], a: dict[str, np.ndarray], kept: Kept) -> dict[str, Any]:
        """Adds ``sum``, the others' partials on its halo, to a chunk of its own; with the last chunk
        (and ``b``), y = tail(P[:, halo] + sum + b) of its own kernels."""
        n, computed, oh, ow = kept.partial.shape
        first, stop, _ = _images(h, n, kept=kept, computed=kept.chunks[-1][1], at=kept.done)
        b, others = a.get("b"), a.get("sum")
        rows = (stop - first, computed, oh, ow)
        if (b is not None and b.shape != (computed,)) or (others is not None and others.shape != rows):
            got = (f"b {b.shape}, " if b is not None else "") + (f"sum {others.shape}" if others is not None else "")
            raise TaskError(f"layer {h['layer']}: tail_forward takes b ({computed},) and sum {rows}; got {got}")
        if (b is not None) != (stop == n):
            raise TaskError(f"layer {h['layer']}: b comes with the last chunk of tail_forward (images up to {n}) only")
        if others is not None:
            kept.partial[first:stop] += others
        kept.done = stop
        if stop < n:
            return {}
        s = kept.partial
        s += b[None, :, None, None]
        y, kept.cache = run_tail(self.backend, self.backend.asarray(s), kept.conv, kept.tail, kept.own)
        kept.partial = None
        self._advance(h, "tail_forward", kept)
        return {"y": y}

    def tail_backward(self, h: dict[str, Any], a: dict[str, np.ndarray], kept: Kept) -> dict[str, Any]:
        """dyc, its own kernels' conv-output gradient, from dy over its halo; kept for partial_backward."""
        be = self.backend
        try:
            d = tail_backward(be, self._on_backend(a["dy"]), kept.cache)
        except ValueError as e:
            raise TaskError(f"layer {h['layer']} step {h['step']}: {e}") from None
        kept.dyc = np.ascontiguousarray(owned(be, d, kept.cache))
        kept.done = 0  # chunks through partial_backward
        self._advance(h, "tail_backward", kept)
        return {"dyc": kept.dyc}

    def partial_backward(self, h: dict[str, Any], a: dict[str, np.ndarray], kept: Kept) -> dict[str, Any]:
        """With the others' dyc before and after its own (all of dY, N x F), the conv backward through
        its partial, one forward chunk at a time: the chunk's dx of its input channels (if need_dx);
        dw (F, c, K, K) and db (F,), summed over the chunks, with the last."""
        n, _, oh, ow = kept.dyc.shape
        chunk = kept.chunks[kept.done]
        first, stop, batch = _images(h, n)
        if (first, stop, batch) != (*chunk, n):
            raise TaskError(
                f"{_where(h)}: partial_backward goes by the forward's chunks; the next is images {[*chunk, n]}"
            )
        parts = [p for p in (a.get("dyc_lo"), kept.dyc[first:stop], a.get("dyc_hi")) if p is not None]
        if not all(p.ndim == 4 and (p.shape[0], *p.shape[2:]) == (stop - first, oh, ow) for p in parts) or (
            sum(p.shape[1] for p in parts) != kept.kernels
        ):
            raise TaskError(
                f"layer {h['layer']}: dyc_lo, this worker's {kept.dyc.shape[1]} kernels' gradient and dyc_hi must make "
                f"({stop - first}, {kept.kernels}, {oh}, {ow}); got {[tuple(p.shape) for p in parts]}"
            )
        be = self.backend
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        dx, dw, db = be.conv2d_backward(be.asarray(whole), kept.conv[kept.done], h["need_dx"])
        kept.done += 1
        if len(kept.chunks) > 1:  # summed over the chunks on the host
            dw, db = be.to_numpy(dw), be.to_numpy(db)
            kept.dw, kept.db = (dw, db) if kept.dw is None else (kept.dw + dw, kept.db + db)
            dw, db = kept.dw, kept.db
        out = {"dx": dx} if h["need_dx"] else {}
        if kept.done < len(kept.chunks):
            return out
        self._advance(h, "partial_backward", kept)
        return {"dw": dw, "db": db} | out

    # ---- calibration -------------------------------------------------------------------------
    def calibrate(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """``times``: seconds per layer, each the median of ``repeats`` runs after a warm-up."""
        if not 1 <= h["repeats"] <= 1000:
            raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
        if not h["layers"]:
            raise TaskError("layers is empty: nothing to calibrate")
        specs = [parse_spec(i, spec, self.max_calibrate_bytes) for i, spec in enumerate(h["layers"])]
        return {"times": [time_block(self.backend, spec, h["repeats"]) * self.slowdown for spec in specs]}

    # ---- data parallelism: a whole replica --------------------------------------------------------
    def replica_calibrate(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """``times``: [seconds of one forward + backward of the replica on ``batch`` random images]."""
        if not 1 <= h["repeats"] <= 1000:
            raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
        if not 1 <= h["batch"] <= 1 << 16:
            raise TaskError(f"batch must be in 1..65536, got {h['batch']}")
        net = self._replica(h["net"], h["batch"])
        return {"times": [time_replica(net, h["net"], h["batch"], h["repeats"]) * self.slowdown]}

    def replica_step(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """The replica, given the master's weights (and batch-norm statistics), on its slice x, y of a
        batch of ``batch``: the slice's part of the gradient, its logits, its statistics after."""
        x, y, spec = a["x"], a["y"], h["net"]
        n = x.shape[0] if x.ndim == 4 else 0
        if not (x.ndim == 4 and n >= 1 and y.shape == (n,) and n <= h["batch"]):
            raise TaskError(f"replica_step takes x (n, C, H, W) and y (n,) with 1 <= n <= batch ({h['batch']}); "
                            f"got x {x.shape}, y {y.shape}")  # fmt: skip
        net = self._replica(spec, n)
        if x.shape[1:] != (spec["in_channels"], spec["image_size"], spec["image_size"]):
            raise TaskError(f"x {x.shape} does not fit the replica's {spec['in_channels']} channels of "
                            f"{spec['image_size']}x{spec['image_size']} pixels")  # fmt: skip
        buffers = a.get("buffers")
        if (buffers is None) != (sum(flat.sizes(net, "buffers")) == 0):
            raise TaskError("buffers must come exactly when the replica has batch-norm statistics")
        try:
            flat.unpack(net, a["params"])
            if buffers is not None:
                flat.unpack(net, buffers, "buffers")
            logits = slice_gradients(net, x, y, h["batch"])
        except ValueError as e:  # a vector of the wrong size, labels out of range
            raise TaskError(str(e)) from None
        out = {"grads": flat.pack(net, "grads"), "logits": logits}
        return out | ({"buffers": flat.pack(net, "buffers")} if buffers is not None else {})

    # ---- the hybrid: the replica's conv part on a slice, the classifier on the master -------------
    def hybrid_calibrate(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """``times``: [seconds of one forward + backward of the replica's conv part on ``batch`` images]."""
        if not 1 <= h["repeats"] <= 1000:
            raise TaskError(f"repeats must be in 1..1000, got {h['repeats']}")
        if not 1 <= h["batch"] <= 1 << 16:
            raise TaskError(f"batch must be in 1..65536, got {h['batch']}")
        net = self._replica(h["net"], h["batch"])
        return {"times": [time_conv_part(net, h["net"], h["batch"], h["repeats"]) * self.slowdown]}

    def hybrid_forward(self, h: dict[str, Any], a: dict[str, np.ndarray], _: None) -> dict[str, Any]:
        """The conv part, given the master's conv weights (and statistics), on its slice x of a batch of
        ``batch``: the features (n, F), its statistics after; the caches kept for hybrid_backward."""
        x, spec = a["x"], h["net"]
        n = x.shape[0] if x.ndim == 4 else 0
        if not (x.ndim == 4 and 1 <= n <= h["batch"] <= 1 << 16):
            raise TaskError(f"hybrid_forward takes x (n, C, H, W) with 1 <= n <= batch ({h['batch']}) <= 65536; "
                            f"got x {x.shape}")  # fmt: skip
        net = self._replica(spec, n)
        if x.shape[1:] != (spec["in_channels"], spec["image_size"], spec["image_size"]):
            raise TaskError(f"x {x.shape} does not fit the replica's {spec['in_channels']} channels of "
                            f"{spec['image_size']}x{spec['image_size']} pixels")  # fmt: skip
        conv, buffers = conv_part(net), a.get("buffers")
        if (buffers is None) != (sum(flat.sizes(conv, "buffers")) == 0):
            raise TaskError("buffers must come exactly when the conv part has batch-norm statistics")
        try:
            flat.unpack(conv, a["params"])  # its size checked before anything is set
            if buffers is not None:
                flat.unpack(conv, buffers, "buffers")
        except ValueError as e:
            raise TaskError(f"hybrid_forward: {e} (the conv part's, without the classifier)") from None
        features = forward_features(conv, x)
        kept = Kept("hybrid", h["step"], images=n, features=feature_shape(net, spec["image_size"]))
        self._advance(h, "hybrid_forward", kept)
        return {"features": features} | ({"buffers": flat.pack(conv, "buffers")} if buffers is not None else {})

    def hybrid_backward(self, h: dict[str, Any], a: dict[str, np.ndarray], kept: Kept) -> dict[str, Any]:
        """The conv part's backward from its rows of dL/dfeatures (n, F): the slice's conv gradient."""
        d, want = a["dfeatures"], (kept.images, math.prod(kept.features))
        if d.shape != want:
            raise TaskError(f"{_where(h)}: dfeatures must be {want} (the slice's images x features of its "
                            f"forward), got {d.shape}")  # fmt: skip
        conv = conv_part(self.replica[1])
        backward_features(conv, d, kept.features)
        self._advance(h, "hybrid_backward", kept)
        return {"grads": flat.pack(conv, "grads")}

    def _replica(self, spec: Any, batch: int) -> Network:
        """The replica ``spec`` describes: the one kept, or a new one (within this worker's memory limit).
        Whoever asks for it runs it, so the hybrid's kept forward, whose caches it holds, is forgotten."""
        self.layers.pop(HYBRID, None)
        key = repr(sorted(spec.items()))
        if self.replica is None or self.replica[0] != key:
            try:
                self.replica = key, build(spec, self.backend, batch, self.max_calibrate_bytes)
            except ValueError as e:
                raise TaskError(f"replica: {e}") from None
        return self.replica[1]

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


def _slot(h: dict[str, Any]) -> int | str:
    """Where a task's kept forward lives: its layer's index, or the hybrid's one slot."""
    return h.get("layer", HYBRID)


def _where(h: dict[str, Any]) -> str:
    """The task's place in a step, for errors: "layer 1 step 3", "the conv part step 3"."""
    slot = _slot(h)
    return f"{'layer ' if isinstance(slot, int) else 'the '}{slot} step {h['step']}"


def _span(h: dict[str, Any], key: str, limit: int) -> tuple[int, int]:
    """Header ``key``, a non-empty range [a, b] with 0 <= a < b <= limit, as a tuple."""
    v = h[key]
    if not (isinstance(v, list) and len(v) == 2 and all(Int.accepts(i) for i in v) and 0 <= v[0] < v[1] <= limit):
        raise TaskError(f"layer {h['layer']}: {key} must be [a, b] with 0 <= a < b <= {limit}, got {v!r}")
    return v[0], v[1]


def _images(
    h: dict[str, Any], n: int, kept: Kept | None = None, computed: int | None = None, at: int | None = None
) -> tuple[int, int, int]:
    """Header ``images`` = [a, b, N], a chunk of a batch of N: (a, b, N), checked; absent: (0, n, n),
    the whole batch. For a task that continues a layer (``kept``), N must be its batch, a must be
    ``at`` (the next image it expects) and b at most ``computed`` (what its forward has so far)."""
    v = h.get("images")
    if v is None:
        v = [0, n, n]
    if not (isinstance(v, list) and len(v) == 3 and all(Int.accepts(i) for i in v) and 0 <= v[0] < v[1] <= v[2]):
        raise TaskError(f"{_where(h)}: images must be [a, b, N] with 0 <= a < b <= N, got {v!r}")
    if kept is not None and (v[2] != n or v[0] != at or v[1] > computed):
        raise TaskError(
            f"{_where(h)}: images {v!r} do not continue this layer's batch of {n}: "
            f"the next chunk starts at image {at}, and its forward has images up to {computed}"
        )
    return v[0], v[1], v[2]
