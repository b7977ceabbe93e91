"""``tinyconv worker``: serve a master's tasks until it says the training is over.

    tinyconv worker --connect tcp://HOST:5555 --backend opencl --device 0:1
    tinyconv worker --connect tcp://HOST:5555 --key me.key_secret --master-key master.key --serve

``--threads N`` limits BLAS / OpenMP threads through environment variables, which those libraries read once,
when numpy is first imported. So this launcher parses its arguments and sets the variables before it imports the
handler, the backends or the transport (all of which import numpy); nothing above :func:`_serve` may import them.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tinyconv.distributed.heap import keep_freed_memory

# The variables the common BLAS / OpenMP builds read for their thread count.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS VECLIB_MAXIMUM_THREADS NUMEXPR_NUM_THREADS".split()
)
EXIT_FAILED = 1  # = transports.zmq_worker's; not imported from there, which would load numpy
EXIT_INTERRUPTED = 130


def _number(kind: type, least: float = 0.0) -> Any:
    """An argparse type: a finite ``kind`` above 0, and at least ``least``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n int' if kind is int else ' number'}") from None
        if not (math.isfinite(value) and value > 0 and value >= least):
            raise argparse.ArgumentTypeError(f"{text!r} must be " + (f">= {least:g}" if least else "> 0"))
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tinyconv worker",
        description="Serve convolution shards to a tinyconv master until it says the training is over.",
    )
    seconds = _number(float)
    p.add_argument(
        "--connect", required=True, metavar="ADDR", help="the master's address: tcp://HOST:5555 or ipc:///path"
    )
    p.add_argument("--backend", default="numpy", help="compute backend: numpy or opencl (default: numpy)")
    p.add_argument("--device", metavar="SPEC", help="which device the backend should use (backend-specific)")
    threads = "limit BLAS/OpenMP threads to N (sets OMP/OPENBLAS/MKL_NUM_THREADS before numpy loads)"
    p.add_argument("--threads", type=_number(int), metavar="N", help=threads)
    slowdown = "testing aid: emulate a device F >= 1 times slower (1 = full speed, 2 = half speed)"
    p.add_argument("--slowdown", type=_number(float, 1.0), default=1.0, metavar="F", help=slowdown)
    heartbeat = "send a heartbeat after S idle seconds (at least as often as the master asks; default: 0.4)"
    p.add_argument("--heartbeat", type=seconds, default=0.4, metavar="S", help=heartbeat)
    timeout = (
        "the most seconds the master may be silent before it is gone: a ceiling, as the patience follows the "
        "master's pace (4 of its heartbeats, or 3 x the longest gap a slow link showed between pieces; default: 30)"
    )
    p.add_argument("--timeout", type=seconds, default=30.0, metavar="S", help=timeout)
    retry = "after losing the master, look for it again (with backoff) for S seconds before exiting (default: 600)"
    p.add_argument("--retry-for", type=seconds, default=600.0, metavar="S", help=retry)
    p.add_argument("--serve", action="store_true", help="stay up after a run ('train over') and serve the next master")
    p.add_argument("--key", metavar="FILE", help="this worker's secret key file (NAME.key_secret from tinyconv keygen)")
    p.add_argument("--master-key", metavar="FILE", help="the master's public key file (NAME.key), with --key")
    connect = "give up when no master has welcomed this worker within S seconds (default: 60)"
    p.add_argument("--connect-timeout", type=seconds, default=60.0, metavar="S", help=connect)
    p.add_argument("--quiet", action="store_true", help="print only problems, not progress")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv worker ...``: returns 0 after the master's shutdown, non-zero with a message otherwise."""
    args = build_parser().parse_args(argv)
    if args.threads:  # before _serve's imports load numpy: BLAS / OpenMP read these once, then
        if "numpy" in sys.modules:
            print(
                "tinyconv worker: warning: numpy was already imported, so --threads may not take effect; "
                "start the worker with `tinyconv worker` or `python -m tinyconv.distributed.worker`",
                file=sys.stderr,
            )
        os.environ.update(dict.fromkeys(THREAD_ENV_VARS, str(args.threads)))
    keep_freed_memory()  # before the compute thread starts: it shares the main heap
    in_main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM ends the worker the same clean way as Ctrl-C: a KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main_thread else None
    before = set(threading.enumerate())
    try:
        code = _serve(args)
    except KeyboardInterrupt:  # during start-up; once serving, serve() handles it the same way
        print("tinyconv worker: interrupted; worker stopping", file=sys.stderr)
        code = EXIT_INTERRUPTED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    if in_main_thread:
        end_if_computing(code, before)
    return code


def end_if_computing(code: int, before: set[threading.Thread]) -> None:
    """End the process now, with ``code``, if a compute thread started since ``before`` is still in a task.

    A worker leaves mid-task on Ctrl-C or SIGTERM, or when its master is gone for good. The compute thread is a
    daemon, but a normal exit runs OpenBLAS's clean-up, which frees the buffers that thread's GEMM is still
    using: a segfault (exit 139) in place of the worker's own code and message. os._exit skips the clean-up.
    Only the worker's process entry calls this: an in-process caller (a test) keeps its threads.
    """
    busy = [t for t in threading.enumerate() if t.name == "worker-compute" and t not in before and t.is_alive()]
    if busy:
        print("tinyconv worker: the task in course is left unfinished", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(args: argparse.Namespace) -> int:
    from backends import get_backend
    from tinyconv.distributed.worker.handler import Worker
    from transports.curve import CurveClient
    from transports.zmq_worker import serve

    options = {"device": args.device} if args.device else {}
    try:
        if (args.key is None) != (args.master_key is None):
            raise ValueError("--key and --master-key go together: this worker's secret key and the master's public key")
        curve = CurveClient(args.key, args.master_key) if args.key else None
    except ValueError as e:  # keys that do not load
        print(f"tinyconv worker: {e}", file=sys.stderr)
        return EXIT_FAILED
    try:
        backend = get_backend(args.backend, **options)
    except Exception as e:  # unknown name, missing driver, no such device: one line, no traceback
        print(f"tinyconv worker: cannot start backend {args.backend!r}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return serve(
        args.connect,
        Worker(backend, slowdown=args.slowdown),
        heartbeat_s=args.heartbeat,
        peer_timeout_s=args.timeout,
        welcome_timeout_s=args.connect_timeout,
        log_line=lambda line: print(f"tinyconv worker: {line}", file=sys.stderr, flush=True),
        quiet=args.quiet,
        curve=curve,
        retry_for=args.retry_for,
        forever=args.serve,
    )
