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
from dataclasses import dataclass, field
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
    cache: Any  # a tinyconv.block.BlockCache; None once part "dw" has used it (frees the columns)
    need_dx: bool
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]  # the computed kernels' weights (own and halo)
    stride: int
    padding: int
    # a backward in parts: "dyc" leaves the conv-output gradient of the computed kernels (for "dw")
    # and of the own ones (host, for "dx"); each part runs once
    d_conv: Any = None
    d: Any = None
    parts: set[str] = field(default_factory=set)


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
        import numpy as np

        from tinyconv.block import block_forward
        from transports.base import Message

        h, a = msg.header, msg.arrays
        x, w, b = a["x"], a["w"], a["b"]
        where = f"layer {h['layer']} step {h['step']}"
        _check_float32(where, x=x, w=w, b=b)
        if x.ndim != 4 or w.ndim != 4 or b.ndim != 1 or x.shape[1] != w.shape[1] or b.shape[0] != w.shape[0]:
            raise TaskError(
                f"{where}: expected x (N, C, H, W), w (F, C, KH, KW), b (F,) with matching C and F; "
                f"got x {x.shape}, w {w.shape}, b {b.shape}"
            )
        stride, padding = h["stride"], h["padding"]
        if stride < 1 or padding < 0:
            raise TaskError(f"{where}: need stride >= 1 and padding >= 0, got {stride} and {padding}")
        oh, ow = _fits(x.shape[2:], w.shape[2:], stride, padding)
        tail, own = self._tail(where, h.get("tail", []), (oh, ow)), h.get("own", [0, w.shape[0]])
        if not (len(own) == 2 and all(_is_int(v) for v in own) and 0 <= own[0] < own[1] <= w.shape[0]):
            raise TaskError(f"{where}: own must be [lo, hi] with 0 <= lo < hi <= {w.shape[0]} kernels, got {own}")

        be = self.backend
        t0 = time.perf_counter()
        y, cache = block_forward(be, be.asarray(x), be.asarray(w), be.asarray(b), stride, padding, tail, tuple(own))
        y = np.ascontiguousarray(be.to_numpy(y))
        be.synchronize()
        compute_s = self._emulate(time.perf_counter() - t0)
        self._forwards[h["layer"]] = _Forward(
            h["step"], cache, h["need_dx"], tuple(x.shape), tuple(w.shape), stride, padding
        )
        header = {"task": h["task"], "step": h["step"], "layer": h["layer"], "compute_s": compute_s}
        return Message("result", header, {"y": y})

    def _conv_backward(self, msg: Message) -> Message:
        """Backward of the last forward of a layer, whole or in three parts (``part`` in the header):

        * none: the tail's and the conv's backward; replies dw, db and (if need_dx) a partial dx.
        * "dyc" (first): the tail's backward; replies this worker's kernels' conv-output gradient
          dyc, and keeps it for the other two parts.
        * "dw": the weights' backward from it; replies dw, db.
        * "dx": dx[:, c0:c1] for ``dx_channels`` [c0, c1] from w (all F kernels, channels c0:c1)
          and the whole layer's conv-output gradient: the arrays dyc_lo and dyc_hi (the other
          participants' kernels before and after this worker's; either absent when there are none)
          around the kept one (the master splits dX by input channels).
        The master sends "dyc" and "dw" together, so the gradient goes back before this worker
        spends time on dW, and "dx" once it has the other participants' gradients.
        """
        import numpy as np

        from tinyconv.block import conv_backward, owned, tail_backward
        from transports.base import Message

        h, a = msg.header, msg.arrays
        layer, step, part = h["layer"], h["step"], h.get("part")
        where = f"layer {layer} step {step}"
        if part not in (None, "dyc", "dw", "dx"):
            raise TaskError(
                f"{where}: part must be 'dyc', 'dw' or 'dx' (or absent for the whole backward), got {part!r}"
            )
        fwd = self._forwards.get(layer)
        if fwd is None:
            raise TaskError(
                f"{where}: no conv_forward of this layer to go back through; "
                "send conv_forward first (or again, if this worker was restarted)"
            )
        if fwd.step != step:
            raise TaskError(f"layer {layer}: backward of step {step}, but the last forward was step {fwd.step}")
        required, allowed = {"dx": ({"w"}, {"w", "dyc_lo", "dyc_hi"}), "dw": (set(), set())}.get(part, ({"dy"}, {"dy"}))
        if not required <= set(a) <= allowed:
            raise TaskError(
                f"{where}: part {part or 'whole'} takes the arrays {sorted(required)}"
                f"{f' and optionally {sorted(allowed - required)}' if allowed != required else ''}, "
                f"got {sorted(a) or 'none'}"
            )
        _check_float32(where, **a)
        be = self.backend
        t0 = time.perf_counter()
        header = {"task": h["task"], "step": step, "layer": layer}
        if part in fwd.parts:
            raise TaskError(f"{where}: part {part!r} of this forward already ran; send conv_forward again")
        if part in ("dw", "dx") and "dyc" not in fwd.parts:
            raise TaskError(f"{where}: part {part!r} needs this worker's conv-output gradient: send part 'dyc' first")
        if part == "dx":
            if "dx_channels" not in h:
                raise TaskError(f"{where}: part 'dx' needs dx_channels [c0, c1] in its header")
            arrays = {"dx": self._dx_channels(where, fwd, h["dx_channels"], a.get("dyc_lo"), a.get("dyc_hi"), a["w"])}
            fwd.d = None
        elif part == "dw":
            _, dw, db = conv_backward(be, fwd.d_conv, fwd.cache, need_dx=False)
            arrays = {"dw": dw, "db": db}
            fwd.d_conv = fwd.cache = None  # frees the forward's columns
        else:
            if part is None and fwd.parts:
                raise TaskError(f"{where}: this forward's backward is running in parts; send the other parts")
            try:
                d = tail_backward(be, be.asarray(a["dy"]), fwd.cache, h.get("dy_from", 0))
            except ValueError as e:  # a dy that does not match the forward; the forward stays for a good one
                raise TaskError(f"{where}: {e}") from None
            if part == "dyc":
                fwd.d_conv = d
                fwd.d = np.ascontiguousarray(owned(be, d, fwd.cache))
                arrays = {"dyc": fwd.d}
            else:
                dx, dw, db = conv_backward(be, d, fwd.cache, fwd.need_dx)
                arrays = {"dw": dw, "db": db} | ({"dx": dx} if fwd.need_dx else {})
        if part is not None:
            fwd.parts.add(part)
        if part is None or fwd.parts == {"dyc", "dw", "dx"}:
            del self._forwards[layer]  # one backward per forward; frees what it kept
        arrays = {name: be.to_numpy(v) for name, v in arrays.items()}
        be.synchronize()
        return Message("result", {**header, "compute_s": self._emulate(time.perf_counter() - t0)}, arrays)

    def _dx_channels(self, where: str, fwd: _Forward, span: Any, lo: Any, hi: Any, w: Any) -> Any:
        """dx[:, c0:c1] from w (F, c1 - c0, KH, KW) and the conv-output gradient (N, F, OH, OW)
        assembled as [lo, the kept own channels, hi] (lo, hi: (N, *, OH, OW) or None)."""
        import numpy as np

        n, c, hgt, wid = fwd.x_shape
        kh, kw = fwd.w_shape[2:]
        if not (len(span) == 2 and all(_is_int(v) for v in span) and 0 <= span[0] < span[1] <= c):
            raise TaskError(f"{where}: dx_channels must be [c0, c1] with 0 <= c0 < c1 <= {c}, got {span}")
        c0, c1 = span
        oh, ow = _fits((hgt, wid), (kh, kw), fwd.stride, fwd.padding)
        parts = [p for p in (lo, fwd.d, hi) if p is not None]
        if any(p.ndim != 4 or (p.shape[0], *p.shape[2:]) != (n, oh, ow) for p in parts):
            raise TaskError(
                f"{where}: dyc_lo and dyc_hi must be ({n}, kernels, {oh}, {ow}); got "
                f"{[tuple(p.shape) for p in (lo, hi) if p is not None]}"
            )
        f = sum(p.shape[1] for p in parts)
        if w.ndim != 4 or tuple(w.shape) != (f, c1 - c0, kh, kw):
            raise TaskError(
                f"{where}: dx of channels [{c0}, {c1}) from {f} kernels' gradients (dyc_lo, this worker's "
                f"{fwd.d.shape[1]}, dyc_hi) needs w ({f}, {c1 - c0}, {kh}, {kw}); got w {tuple(w.shape)}"
            )
        dyc = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        be = self.backend
        return be.conv2d_backward_input(be.asarray(dyc), be.asarray(w), (n, c1 - c0, hgt, wid), fwd.stride, fwd.padding)

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

        Replies ``times`` (forward + backward) and ``forward_times`` (the forward alone, in the
        same runs): seconds per layer, each the median of ``repeats`` runs after a warm-up."""
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
        times, forward_times = [], []
        for layer, xs, ws, ys, stride, padding, need_dx, tail in shapes:
            rng = np.random.default_rng(layer)  # same values on every worker: only the device differs
            x = be.asarray(rng.standard_normal(xs, dtype=np.float32))
            w = be.asarray(rng.standard_normal(ws, dtype=np.float32) * np.float32(0.1))
            b = be.asarray(rng.standard_normal(ws[0], dtype=np.float32))
            dy = be.asarray(rng.standard_normal(ys, dtype=np.float32))

            args = (x, w, b, dy, stride, padding, need_dx, tail)
            self._time_once(*args)  # warm-up: first-call costs (allocation, kernel compilation) are not speed
            runs = [self._time_once(*args) for _ in range(repeats)]
            times.append(statistics.median(t for _, t in runs) * self.slowdown)
            forward_times.append(statistics.median(t for t, _ in runs) * self.slowdown)
        compute_s = self._emulate(time.perf_counter() - t_start)
        header = {"task": msg.header["task"], "times": times, "forward_times": forward_times, "compute_s": compute_s}
        return Message("result", header)

    def _time_once(
        self, x: Any, w: Any, b: Any, dy: Any, stride: int, padding: int, need_dx: bool, tail: list
    ) -> tuple[float, float]:
        """(seconds of the forward, seconds of forward + backward) of one block."""
        from tinyconv.block import block_backward, block_forward

        be = self.backend
        t0 = time.perf_counter()
        _, cache = block_forward(be, x, w, b, stride, padding, tail)
        be.synchronize()
        t_forward = time.perf_counter() - t0
        block_backward(be, dy, cache, 0, need_dx)
        be.synchronize()
        return t_forward, time.perf_counter() - t0

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
    from backends import get_backend
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
