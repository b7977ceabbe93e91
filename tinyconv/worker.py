"""The worker: computes the convolution kernels a master hands it, on one Backend.

Two parts:

* :class:`ConvWorker`, the handler every transport serves (``hello()`` and
  ``handle(msg)``, see ``transports.base.Handler``). It answers ``calibrate``
  (time this layer shape here), ``conv_forward`` (keeping the backend's cache per
  layer) and ``conv_backward`` (using it). Any problem becomes an ``error`` reply.
* The command line, ``tinyconv worker --connect tcp://HOST:5555 ...`` (also
  ``python -m tinyconv.worker``), which serves a ConvWorker over ZeroMQ until the
  master says the training is over; plus :func:`spawn_local_workers` /
  :func:`stop_workers` for a master that runs its workers on the same machine.

Why this module imports nothing heavy at the top: ``--threads N`` limits BLAS /
OpenMP threads through environment variables, which those libraries read once,
when numpy is first imported. ``main()`` therefore parses its arguments and sets
the variables *before* importing numpy, the backends or the transports; methods
below import them where they are used (Python caches the imports, so that is free).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinyconv.heap import keep_freed_memory

if TYPE_CHECKING:
    from backends.base import Backend
    from transports.base import Message

# The variables the common BLAS / OpenMP builds read for their thread count.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
DEFAULT_MAX_CALIBRATE_BYTES = 1 << 31  # 500:1500 with its tail at batch 64 needs about 1.6 GB
# = transports.zmq_transport.EXIT_INTERRUPTED; not imported from there, which would load numpy
EXIT_INTERRUPTED = 130


class TaskError(ValueError):
    """A task the worker cannot run as asked; the text goes back to the master."""


@dataclass
class _Forward:
    """What a conv_forward leaves for the matching conv_backward."""

    step: int
    need_dx: bool
    kernels: int  # the kernels of the weights it got: the computed ones, or (by input channels) all F
    tail: list[dict[str, Any]]
    own: tuple[int, int]  # the own kernels, as offsets into the computed ones
    cache: Any = None  # a tinyconv.block.BlockCache once the tail ran
    # split by input channels: the backend's cache of the partial convolution; its computed
    # kernels' part (N, ce - cs, OH, OW) until part "tail"; the own kernels' conv-output gradient
    conv: Any = None
    partial: Any = None
    dyc: Any = None


class ConvWorker:
    """Serves convolution tasks on ``backend``; the handler behind every transport.

    ``slowdown`` F >= 1 is a testing aid that emulates a slower device: after each
    task the worker waits an extra (F - 1) x its compute time and reports F x
    that time (calibration times included), so a master balances it as slower.
    """

    def __init__(
        self, backend: Backend, slowdown: float = 1.0, max_calibrate_bytes: int = DEFAULT_MAX_CALIBRATE_BYTES
    ) -> None:
        if not (isinstance(slowdown, (int, float)) and math.isfinite(slowdown) and slowdown >= 1):
            raise ValueError(f"slowdown must be a finite number >= 1, got {slowdown!r}")
        self.backend = backend
        self.slowdown = float(slowdown)
        self.max_calibrate_bytes = int(max_calibrate_bytes)
        self._forwards: dict[int, _Forward] = {}  # layer -> its last forward
        self._idle = threading.Event()  # never set: waiting on it is how slowdown passes time

    def hello(self) -> dict[str, Any]:
        """The ``hello`` header: protocol, backend, device facts, pid, hostname."""
        from transports.base import PROTOCOL_VERSION

        device = dict(self.backend.describe())
        if self.slowdown != 1.0:
            device["slowdown"] = self.slowdown
        return {
            "protocol": PROTOCOL_VERSION,
            "backend": self.backend.name,
            "device": device,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def handle(self, msg: Message) -> Message:
        """Answer one task with a ``result``, or an ``error`` naming what was wrong. Never raises."""
        from transports.wire import error_reply

        handlers = {
            "conv_forward": self._conv_forward,
            "conv_backward": self._conv_backward,
            "calibrate": self._calibrate,
        }
        if msg.kind not in handlers:
            return error_reply(msg, f"a worker does not handle {msg.kind!r} messages; send one of {list(handlers)}")
        try:
            return handlers[msg.kind](msg)
        except TaskError as e:
            return error_reply(msg, f"{msg.kind}: {e}")
        except Exception as e:  # a backend failure: report it, keep serving
            return error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")

    # ---- tasks ----------------------------------------------------------------------
    def _conv_forward(self, msg: Message) -> Message:
        """Forward of one layer's slice, whole or in two parts (``part`` in the header):

        * none (split by kernels): x (N, C, H, W), w and b of the computed kernels (own and halo);
          the conv and its tail; replies y, the tail's output for the ``own`` kernels.
        * "conv" (split by input channels, first): x (N, c, H, W) -- this worker's input channels --
          and w (F, c, KH, KW) -- all F kernels on those channels; the *partial* convolution
          P = sum over its channels (N, F, OH, OW), no bias. Replies the parts of P that the other
          participants' kernels need, ``give`` = [lo_end, hi_start]: p_lo = P[:, :lo_end] and
          p_hi = P[:, hi_start:] (each absent when empty), and keeps P[:, ext] for ``ext`` = [cs, ce),
          the kernels it computes the tail of (own and halo).
        * "tail" (then): ``sum``, the other participants' partials summed over ext (absent when
          nobody else has channels), and b (ce - cs,); y = tail(P[:, ext] + sum + b) for the
          ``own`` kernels (offsets into ext).
        """
        import numpy as np

        from tinyconv.block import block_forward
        from transports.base import Message

        h, a = msg.header, msg.arrays
        layer, step, part = h["layer"], h["step"], h.get("part")
        where = f"layer {layer} step {step}"
        if part not in (None, "conv", "tail"):
            raise TaskError(f"{where}: forward part must be 'conv' or 'tail' (or absent for the whole), got {part!r}")
        arrays_of = {None: ({"x", "w", "b"},) * 2, "conv": ({"x", "w"},) * 2, "tail": ({"b"}, {"b", "sum"})}
        required, allowed = arrays_of[part]
        _check_arrays(where, f"forward part {part or 'whole'}", a, required, allowed)
        be = self.backend
        if part == "tail":
            return self._forward_tail(where, h, a)

        x, w, b = a["x"], a["w"], a.get("b")
        if x.ndim != 4 or w.ndim != 4 or x.shape[1] != w.shape[1] or (b is not None and b.shape != w.shape[:1]):
            raise TaskError(
                f"{where}: expected x (N, C, H, W), w (F, C, KH, KW) and (whole) b (F,) with matching C and F; "
                f"got x {x.shape}, w {w.shape}" + (f", b {b.shape}" if b is not None else "")
            )
        stride, padding = h["stride"], h["padding"]
        if stride < 1 or padding < 0:
            raise TaskError(f"{where}: need stride >= 1 and padding >= 0, got {stride} and {padding}")
        oh, ow = _fits(x.shape[2:], w.shape[2:], stride, padding)
        tail = self._tail(where, h.get("tail", []), (oh, ow))
        f = w.shape[0]
        if part is None:
            ext = [0, f]
        else:
            ext = h.get("ext")
            if not _span(ext, 0, f):
                raise TaskError(f"{where}: part 'conv' needs ext [cs, ce] with 0 <= cs < ce <= {f} kernels, got {ext}")
        own = h.get("own", [0, ext[1] - ext[0]])
        if not _span(own, 0, ext[1] - ext[0]):
            raise TaskError(f"{where}: own must be [lo, hi] with 0 <= lo < hi <= {ext[1] - ext[0]} kernels, got {own}")
        fwd = _Forward(step, h["need_dx"], f, tail, tuple(own))

        t0 = time.perf_counter()
        if part is None:
            x, w, b = be.asarray(x), be.asarray(w), be.asarray(b)
            y, fwd.cache = block_forward(be, x, w, b, stride, padding, tail, fwd.own)
            arrays = {"y": np.ascontiguousarray(be.to_numpy(y))}
        else:
            give = h.get("give", [0, f])
            if not (isinstance(give, list) and len(give) == 2 and all(_is_int(v) and 0 <= v <= f for v in give)):
                raise TaskError(f"{where}: give must be [lo_end, hi_start] within [0, {f}], got {give}")
            p, fwd.conv = be.conv2d_forward(be.asarray(x), be.asarray(w), be.zeros((f,)), stride, padding)
            p = be.to_numpy(p)
            fwd.partial = p[:, ext[0] : ext[1]]
            arrays = {}
            if give[0] > 0:
                arrays["p_lo"] = np.ascontiguousarray(p[:, : give[0]])
            if give[1] < f:
                arrays["p_hi"] = np.ascontiguousarray(p[:, give[1] :])
        be.synchronize()
        compute_s = self._emulate(time.perf_counter() - t0)
        self._forwards[layer] = fwd
        return Message("result", {"task": h["task"], "step": step, "layer": layer, "compute_s": compute_s}, arrays)

    def _forward_tail(self, where: str, h: dict[str, Any], a: dict[str, Any]) -> Message:
        """Part "tail" of a forward split by input channels (see :meth:`_conv_forward`)."""
        import numpy as np

        from tinyconv.block import tail_forward
        from transports.base import Message

        fwd = self._kept(where, h["layer"], h["step"])
        if fwd.partial is None:
            raise TaskError(f"{where}: part 'tail' needs this worker's partial convolution: send part 'conv' first")
        n, computed, oh, ow = fwd.partial.shape
        b, total = a["b"], a.get("sum")
        if b.shape != (computed,) or (total is not None and total.shape != fwd.partial.shape):
            raise TaskError(
                f"{where}: part 'tail' takes b ({computed},) and sum {fwd.partial.shape}; got b {b.shape}"
                + (f", sum {total.shape}" if total is not None else "")
            )
        be = self.backend
        t0 = time.perf_counter()
        s = fwd.partial + b[None, :, None, None]
        if total is not None:
            s += total
        fwd.partial = None
        y, fwd.cache = tail_forward(be, be.asarray(s), fwd.conv, fwd.tail, fwd.own)
        y = np.ascontiguousarray(be.to_numpy(y))
        be.synchronize()
        compute_s = self._emulate(time.perf_counter() - t0)
        header = {"task": h["task"], "step": h["step"], "layer": h["layer"], "compute_s": compute_s}
        return Message("result", header, {"y": y})

    def _kept(self, where: str, layer: int, step: int) -> _Forward:
        """The last forward of ``layer``, which must be of ``step``."""
        fwd = self._forwards.get(layer)
        if fwd is None:
            raise TaskError(
                f"{where}: no conv_forward of this layer to go on from; "
                "send conv_forward first (or again, if this worker was restarted)"
            )
        if fwd.step != step:
            raise TaskError(f"layer {layer}: a task of step {step}, but the last forward was step {fwd.step}")
        return fwd

    def _conv_backward(self, msg: Message) -> Message:
        """Backward of the last forward of a layer, whole or in two parts (``part`` in the header):

        * none (split by kernels): dy, the tail-output gradient from channel ``dy_from`` of the
          computed kernels; the tail's and the conv's backward; replies dw, db of the own kernels
          and (if need_dx) a partial dx of all input channels.
        * "tail" (split by input channels, first): dy as above; the tail's backward; replies dyc,
          the own kernels' conv-output gradient (N, own, OH, OW), and keeps it.
        * "conv" (then): dyc_lo and dyc_hi, the other participants' conv-output gradients for the
          kernels before and after the own ones (either absent when there are none); with the
          kept one they make all of dY (N, F, OH, OW), and the conv's backward through this
          worker's partial gives dx (N, c, H, W) of its input channels (if need_dx),
          dw (F, c, KH, KW) and db (F,).
        """
        import numpy as np

        from tinyconv.block import conv_backward, owned, tail_backward
        from transports.base import Message

        h, a = msg.header, msg.arrays
        layer, step, part = h["layer"], h["step"], h.get("part")
        where = f"layer {layer} step {step}"
        if part not in (None, "tail", "conv"):
            raise TaskError(f"{where}: backward part must be 'tail' or 'conv' (or absent for the whole), got {part!r}")
        fwd = self._kept(where, layer, step)
        if fwd.cache is None:
            raise TaskError(f"{where}: the forward of this layer is not finished: send its part 'tail' first")
        by_channels = fwd.conv is not None
        if by_channels != (part is not None):
            raise TaskError(
                f"{where}: this layer's forward was split by {'input channels' if by_channels else 'kernels'}: "
                f"its backward goes {'in parts tail, conv' if by_channels else 'whole (no part)'}, got part {part!r}"
            )
        if part == "conv":
            _check_arrays(where, "backward part conv", a, set(), {"dyc_lo", "dyc_hi"})
        else:
            _check_arrays(where, f"backward part {part or 'whole'}", a, {"dy"}, {"dy"})
        if part == "tail" and fwd.dyc is not None:
            raise TaskError(f"{where}: part 'tail' of this backward already ran; send part 'conv'")
        if part == "conv" and fwd.dyc is None:
            raise TaskError(f"{where}: part 'conv' needs this worker's conv-output gradient: send part 'tail' first")
        be = self.backend
        t0 = time.perf_counter()
        if part == "conv":
            dx, dw, db = be.conv2d_backward(be.asarray(self._whole_dy(where, fwd, a)), fwd.conv, fwd.need_dx)
            arrays = {"dw": dw, "db": db} | ({"dx": dx} if fwd.need_dx else {})
        else:
            try:
                d = tail_backward(be, be.asarray(a["dy"]), fwd.cache, h.get("dy_from", 0))
            except ValueError as e:  # a dy that does not match the forward; the forward stays for a good one
                raise TaskError(f"{where}: {e}") from None
            if part == "tail":
                fwd.dyc = np.ascontiguousarray(owned(be, d, fwd.cache))
                arrays = {"dyc": fwd.dyc}
            else:
                dx, dw, db = conv_backward(be, d, fwd.cache, fwd.need_dx)
                arrays = {"dw": dw, "db": db} | ({"dx": dx} if fwd.need_dx else {})
        if part != "tail":
            del self._forwards[layer]  # one backward per forward; frees what it kept
        arrays = {name: be.to_numpy(v) for name, v in arrays.items()}
        be.synchronize()
        header = {"task": h["task"], "step": step, "layer": layer}
        return Message("result", {**header, "compute_s": self._emulate(time.perf_counter() - t0)}, arrays)

    @staticmethod
    def _whole_dy(where: str, fwd: _Forward, a: dict[str, Any]) -> Any:
        """All of dY (N, F, OH, OW): dyc_lo, the kept own kernels' gradient, dyc_hi."""
        import numpy as np

        f = fwd.kernels
        parts = [p for p in (a.get("dyc_lo"), fwd.dyc, a.get("dyc_hi")) if p is not None]
        n, _, oh, ow = fwd.dyc.shape
        fits = all(p.ndim == 4 and (p.shape[0], *p.shape[2:]) == (n, oh, ow) for p in parts)
        if not fits or sum(p.shape[1] for p in parts) != f:
            raise TaskError(
                f"{where}: dyc_lo, this worker's {fwd.dyc.shape[1]} kernels' gradient and dyc_hi must make "
                f"({n}, {f}, {oh}, {ow}); got {[tuple(p.shape) for p in parts]}"
            )
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    @staticmethod
    def _tail(where: str, tail: Any, hw: tuple[int, int]) -> list[dict[str, Any]]:
        """A checked tail spec list (see tinyconv.block) for a conv output of size ``hw``."""
        from tinyconv.block import check_tail, tail_output_hw

        try:
            check_tail(tail)
            tail_output_hw(*hw, tail)
        except ValueError as e:
            raise TaskError(f"{where}: {e}") from None
        return tail

    def _calibrate(self, msg: Message) -> Message:
        """Time forward + backward of each layer's exact shape on seeded random values.

        Replies ``times``: seconds per layer, each the median of ``repeats`` runs after a warm-up."""
        import numpy as np

        from transports.base import Message

        repeats, specs = msg.header["repeats"], msg.header["layers"]
        if not 1 <= repeats <= 1000:
            raise TaskError(f"repeats must be in 1..1000, got {repeats}")
        if not specs:
            raise TaskError("layers is empty: nothing to calibrate")
        shapes = [self._calibration_shape(i, spec) for i, spec in enumerate(specs)]

        be = self.backend
        t_start = time.perf_counter()
        times = []
        for layer, xs, ws, ys, stride, padding, need_dx, tail in shapes:
            rng = np.random.default_rng(layer)  # same values on every worker: only the device differs
            x = be.asarray(rng.standard_normal(xs, dtype=np.float32))
            w = be.asarray(rng.standard_normal(ws, dtype=np.float32) * np.float32(0.1))
            b = be.asarray(rng.standard_normal(ws[0], dtype=np.float32))
            dy = be.asarray(rng.standard_normal(ys, dtype=np.float32))

            args = (x, w, b, dy, stride, padding, need_dx, tail)
            self._time_once(*args)  # warm-up: first-call costs (allocation, kernel compilation) are not speed
            runs = [self._time_once(*args) for _ in range(repeats)]
            times.append(statistics.median(runs) * self.slowdown)
        compute_s = self._emulate(time.perf_counter() - t_start)
        header = {"task": msg.header["task"], "times": times, "compute_s": compute_s}
        return Message("result", header)

    def _time_once(
        self, x: Any, w: Any, b: Any, dy: Any, stride: int, padding: int, need_dx: bool, tail: list
    ) -> float:
        """Seconds of forward + backward of one block."""
        from tinyconv.block import block_backward, block_forward

        be = self.backend
        t0 = time.perf_counter()
        _, cache = block_forward(be, x, w, b, stride, padding, tail)
        block_backward(be, dy, cache, 0, need_dx)
        be.synchronize()
        return time.perf_counter() - t0

    def _calibration_shape(self, i: int, spec: Any) -> tuple:
        """Check one calibrate layer spec -> (layer, x, w, y shapes, stride, padding, need_dx, tail).

        y is the shape of the block's output: after the tail (tinyconv.block), if one is given.
        """
        allowed = {"layer", "x", "w", "stride", "padding", "need_dx", "tail"}
        if not isinstance(spec, dict) or not {"layer", "x", "w", "stride", "padding"} <= set(spec) <= allowed:
            raise TaskError(
                f"layers[{i}] must be a map with layer, x [N,C,H,W], w [F,C,K,K], stride, padding "
                f"(and optionally need_dx, tail); got {spec!r:.200}"
            )
        layer, xs, ws = spec["layer"], spec["x"], spec["w"]
        stride, padding, need_dx = spec["stride"], spec["padding"], spec.get("need_dx", True)
        for name, shape in (("x", xs), ("w", ws)):
            if not (isinstance(shape, list) and len(shape) == 4 and all(_is_int(s) and s > 0 for s in shape)):
                raise TaskError(f"layers[{i}].{name} must be 4 positive ints, got {shape!r:.100}")
        if not (_is_int(layer) and _is_int(stride) and _is_int(padding) and isinstance(need_dx, bool)):
            raise TaskError(f"layers[{i}]: layer, stride, padding must be ints and need_dx a bool")
        if xs[1] != ws[1] or stride < 1 or padding < 0:
            raise TaskError(f"layers[{i}]: x {xs} and w {ws} need the same C, stride >= 1, padding >= 0")
        n, c, hgt, wid = xs
        f, _, kh, kw = ws
        oh, ow = _fits((hgt, wid), (kh, kw), stride, padding)
        tail = self._tail(f"layers[{i}]", spec.get("tail", []), (oh, ow))
        from tinyconv.block import tail_output_hw

        ys = [n, f, *tail_output_hw(oh, ow, tail)]
        # the im2col columns dominate: C*KH*KW x N*OH*OW, next to x, dx, w, y and dy
        floats = c * kh * kw * n * oh * ow + 2 * math.prod(xs) + math.prod(ws) + 6 * n * f * oh * ow
        if 4 * floats > self.max_calibrate_bytes:
            raise TaskError(
                f"layers[{i}]: timing x {xs}, w {ws} needs about {4 * floats} bytes, over this worker's "
                f"limit of {self.max_calibrate_bytes}"
            )
        return layer, tuple(xs), tuple(ws), tuple(ys), stride, padding, need_dx, tail

    def _emulate(self, compute_s: float) -> float:
        """Apply the slowdown factor: wait the extra time, return the time to report."""
        if self.slowdown > 1.0:
            self._idle.wait((self.slowdown - 1.0) * compute_s)  # emulation of a slower device, not a sync
        return compute_s * self.slowdown


def _fits(size: Sequence[int], kernel: Sequence[int], stride: int, padding: int) -> tuple[int, int]:
    """(OH, OW) of a convolution, or a TaskError naming why the kernel does not fit."""
    from backends.base import conv_output_size

    try:
        return tuple(conv_output_size(s, k, stride, padding) for s, k in zip(size, kernel, strict=True))
    except ValueError as e:
        raise TaskError(str(e)) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _span(v: Any, lo: int, hi: int) -> bool:
    """v is [a, b] with lo <= a < b <= hi."""
    return isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v) and lo <= v[0] < v[1] <= hi


def _check_arrays(where: str, what: str, arrays: dict[str, Any], required: set[str], allowed: set[str]) -> None:
    """The task's arrays are ``required`` plus some of ``allowed``, all float32."""
    if not required <= set(arrays) <= allowed:
        optional = allowed - required
        raise TaskError(
            f"{where}: {what} takes the arrays {sorted(required)}"
            f"{f' and optionally {sorted(optional)}' if optional else ''}, got {sorted(arrays) or 'none'}"
        )
    _check_float32(where, **arrays)


def _check_float32(where: str, **arrays: Any) -> None:
    for name, a in arrays.items():
        if a.dtype.name != "float32":
            raise TaskError(f"{where}: {name} must be float32, got {a.dtype}")


# ---- command line --------------------------------------------------------------------


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n int' if kind is int else ' number'}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse


def _slowdown(text: str) -> float:
    value = _positive(float)(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"slowdown {text!r} must be >= 1 (1 = full speed, 2 = half speed)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tinyconv worker",
        description="Serve convolution kernels to a tinyconv master until it says the training is over.",
    )
    p.add_argument(
        "--connect",
        required=True,
        metavar="ADDR",
        help="the master's address: tcp://HOST:5555 or ipc:///path",
    )
    p.add_argument("--backend", default="numpy", help="compute backend: numpy or opencl (default: numpy)")
    p.add_argument("--device", metavar="SPEC", help="which device the backend should use (backend-specific)")
    p.add_argument(
        "--threads",
        type=_positive(int),
        metavar="N",
        help="limit BLAS/OpenMP threads to N (sets OMP/OPENBLAS/MKL_NUM_THREADS before numpy loads)",
    )
    p.add_argument(
        "--slowdown",
        type=_slowdown,
        default=1.0,
        metavar="F",
        help="testing aid: emulate a device F times slower (default: 1)",
    )
    p.add_argument(
        "--heartbeat",
        type=_positive(float),
        default=1.0,
        metavar="S",
        help="send a heartbeat after S idle seconds (at least as often as the master asks; default: 1)",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=10.0,
        metavar="S",
        help="exit when the master has been silent for S seconds (default: 10)",
    )
    p.add_argument(
        "--connect-timeout",
        type=_positive(float),
        default=60.0,
        metavar="S",
        help="give up when no master has welcomed this worker within S seconds (default: 60)",
    )
    p.add_argument("--quiet", action="store_true", help="print only problems, not progress")
    return p


def limit_threads(n: int) -> None:
    """Ask BLAS / OpenMP for ``n`` threads. Only works before numpy is imported."""
    if "numpy" in sys.modules:
        print(
            "tinyconv worker: warning: numpy was already imported, so --threads may not take effect; "
            "start the worker with `tinyconv worker` or `python -m tinyconv.worker`",
            file=sys.stderr,
        )
    for var in THREAD_ENV_VARS:
        os.environ[var] = str(n)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the worker the same clean way as Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv worker ...``: returns 0 after the master's shutdown, non-zero with a message otherwise."""
    args = build_parser().parse_args(argv)
    if args.threads:
        limit_threads(args.threads)  # before the imports below load numpy
    keep_freed_memory()  # before the compute thread starts: it shares the main heap
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main_thread else None
    try:
        return _run(args)
    except KeyboardInterrupt:  # during start-up; once serving, serve() handles it the same way
        print("tinyconv worker: interrupted; worker stopping", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from tinyconv.plugins import get_backend
    from transports.zmq_transport import EXIT_FAILED, serve

    options = {"device": args.device} if args.device else {}
    try:
        backend = get_backend(args.backend, **options)
    except Exception as e:  # unknown name, missing driver, no such device: one line, no traceback
        print(f"tinyconv worker: cannot start backend {args.backend!r}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return serve(
        args.connect,
        ConvWorker(backend, slowdown=args.slowdown),
        heartbeat_s=args.heartbeat,
        peer_timeout_s=args.timeout,
        welcome_timeout_s=args.connect_timeout,
        log_line=lambda line: print(f"tinyconv worker: {line}", file=sys.stderr, flush=True),
        quiet=args.quiet,
    )


# ---- local workers for a master ---------------------------------------------------------


def spawn_local_workers(
    n: int,
    connect: str,
    backend: str = "numpy",
    extra_args: Sequence[str] = (),
    threads: int | None = None,
    quiet: bool = True,
) -> list[subprocess.Popen]:
    """Start ``n`` worker processes on this machine that connect to ``connect``.

    They stay in this process's group, so a Ctrl-C reaches them too; and each
    exits on its own within its ``--timeout`` if this process dies. Stop them with
    :func:`stop_workers` after closing the transport.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    cmd = [sys.executable, "-m", "tinyconv.worker", "--connect", connect, "--backend", backend]
    if threads:
        cmd += ["--threads", str(threads)]
    if quiet:
        cmd.append("--quiet")
    cmd += list(extra_args)
    return [subprocess.Popen(cmd) for _ in range(n)]


def stop_workers(procs: Sequence[subprocess.Popen], timeout: float = 5.0) -> list[int]:
    """Wait up to ``timeout`` s for the workers to exit, then terminate, then kill. Returns exit codes."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


if __name__ == "__main__":
    sys.exit(main())
