"""``tinyconv worker``: serve a master's tasks until it says the training is over.

    tinyconv worker --connect tcp://HOST:5555 --backend opencl --device 0:1
    tinyconv worker --connect tcp://HOST:5555 --key me.key_secret --master-key master.key --serve

``--threads N`` limits BLAS / OpenMP threads through environment variables, which those libraries read once,
when numpy is first imported. So this launcher parses its arguments and sets the variables (:func:`set_threads`)
before it imports the handler, the backends or the transport (all of which import numpy). A bad option (a --device
for a backend without devices, a key file that does not load) is one line on stderr and exit 2, before any work.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tinyconv.distributed.heap import keep_freed_memory
from tinyconv.options import POSITIVE, Parser, UsageError, add

# The variables the common BLAS / OpenMP builds read for their thread count.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS VECLIB_MAXIMUM_THREADS NUMEXPR_NUM_THREADS".split()
)
EXIT_FAILED, EXIT_USAGE = 1, 2  # 1: transports.zmq_worker's (not imported: it loads numpy); 2: a bad option
EXIT_INTERRUPTED = 130


def build_parser() -> Parser:
    about = "Serve convolution shards to a tinyconv master until it says the training is over."
    p = Parser(prog="tinyconv worker", description=about)
    connect = "the master's address: tcp://HOST:5555 or ipc:///path"
    p.add_argument("--connect", required=True, metavar="ADDR", help=connect)
    add(p, "backend", "device", "threads", "slowdown", defaults={"backend": "numpy", "slowdown": 1.0})
    heartbeat = "send a heartbeat after S idle seconds (at least as often as the master asks; default 0.4)"
    p.add_argument("--heartbeat", type=POSITIVE, default=0.4, metavar="S", help=heartbeat)
    pace = "here the master's: 4 of its heartbeats, or 3 x the longest gap a slow link showed between pieces"
    timeouts = {"peer_timeout": 30.0, "start_timeout": 60.0}  # the master's welcome, or the worker gives up
    add(p, "peer_timeout", "start_timeout", defaults=timeouts, helps={"peer_timeout": pace})
    retry = "after losing the master, look for it again (with backoff) for S seconds before exiting (default 600)"
    p.add_argument("--retry-for", type=POSITIVE, default=600.0, metavar="S", help=retry)
    p.add_argument("--serve", action="store_true", help="stay up after a run ('train over') and serve the next master")
    p.add_argument("--key", metavar="FILE", help="this worker's secret key file (NAME.key_secret from tinyconv keygen)")
    p.add_argument("--master-key", metavar="FILE", help="the master's public key file (NAME.key), with --key")
    add(p, "no_progress")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``tinyconv worker ...``: 0 after the master's shutdown, 2 for a bad option, else non-zero with a message."""
    try:
        args = build_parser().parse_args(argv)
        set_threads(args.threads)  # before check_args loads a backend, and with it numpy
        curve = check_args(args)
    except UsageError as e:
        print(f"tinyconv worker: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    keep_freed_memory()  # before the compute thread starts: it shares the main heap
    in_main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM ends the worker the same clean way as Ctrl-C: a KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main_thread else None
    before = set(threading.enumerate())
    try:
        code = _serve(args, curve)
    except KeyboardInterrupt:  # during start-up; once serving, serve() handles it the same way
        print("tinyconv worker: interrupted; worker stopping", file=sys.stderr)
        code = EXIT_INTERRUPTED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
    if in_main_thread:
        end_if_computing(code, before)
    return code


def set_threads(threads: int | None) -> None:
    """--threads N: the BLAS / OpenMP thread variables, which those libraries read once, when numpy loads."""
    if not threads:
        return
    if "numpy" in sys.modules:
        print(
            "tinyconv worker: warning: numpy was already imported, so --threads may not take effect; "
            "start the worker with `tinyconv worker` or `python -m tinyconv.distributed.worker`",
            file=sys.stderr,
        )
    os.environ.update(dict.fromkeys(THREAD_ENV_VARS, str(threads)))


def check_args(args: argparse.Namespace) -> Any:
    """UsageError for a backend or device that cannot be asked for, or keys that do not load; -> the
    CurveClient of --key and --master-key (None without them). Loads the backend's module: after set_threads."""
    from backends import available_backends, has_devices
    from transports.curve import CurveClient

    known = available_backends()
    if args.backend not in known:
        raise UsageError(f"--backend {args.backend}: not one of {', '.join(known)} (`tinyconv devices` lists them)")
    if args.device and not has_devices(args.backend):
        others = ", ".join(b for b in known if b != args.backend)
        raise UsageError(
            f"--device {args.device}: the {args.backend} backend has no devices to choose from; drop "
            f"--device or use a backend that has some ({others})"
        )
    if (args.key is None) != (args.master_key is None):
        raise UsageError("--key and --master-key go together: this worker's secret key and the master's public key")
    try:
        return CurveClient(args.key, args.master_key) if args.key else None
    except ValueError as e:  # a file that is missing or holds no key: say how key files are made
        why = str(e).split("; make key files", 1)[0]
        raise UsageError(f"{why}; make key pairs with `tinyconv keygen DIR --name NAME`") from None


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


def _serve(args: argparse.Namespace, curve: Any) -> int:
    from backends import get_backend
    from tinyconv.distributed.worker.handler import Worker
    from transports.zmq_worker import serve

    options = {"device": args.device} if args.device else {}
    try:
        backend = get_backend(args.backend, **options)
    except Exception as e:  # a missing driver, no such device: one line, no traceback
        print(f"tinyconv worker: cannot start backend {args.backend!r}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return serve(
        args.connect,
        Worker(backend, slowdown=args.slowdown),
        heartbeat_s=args.heartbeat,
        peer_timeout_s=args.peer_timeout,
        welcome_timeout_s=args.start_timeout,
        log_line=lambda line: print(f"tinyconv worker: {line}", file=sys.stderr, flush=True),
        quiet=args.no_progress,
        curve=curve,
        retry_for=args.retry_for,
        forever=args.serve,
    )
