"""A tiny handler for the transport tests, and a worker process that serves it over ZeroMQ.

The transports know nothing of the tasks they carry, so they are tested with tasks
of their own: ``echo`` (its ``x`` comes back as ``y = 2 x + 1``), ``fail`` (the
handler raises), ``slow`` (it computes for ``seconds``), ``bad_reply`` (the reply
holds a numpy scalar), ``quiet`` (no reply). Anything else is answered by an error.

    python tests/echo_worker.py CONNECT [--protocol N] [--heartbeat S] [--timeout S]

runs :func:`transports.zmq_worker.serve` with it and exits with serve's code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from transports.base import Message
from transports.wire import error_reply
from transports.zmq_worker import serve

PROTOCOL = 7  # the task protocol these tests speak


class EchoHandler:
    """The worker side of the tests' task protocol (see the module docstring)."""

    def __init__(self, protocol: int = PROTOCOL) -> None:
        self.protocol = protocol

    def hello(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol,
            "backend": "echo",
            "device": {"name": "test device"},
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def handle(self, msg: Message) -> Message | None:
        task = msg.header.get("task")
        if msg.kind == "echo":
            return Message("echoed", {"task": task, "seen": msg.header}, {"y": msg.arrays["x"] * 2 + 1})
        if msg.kind == "fail":
            raise RuntimeError(msg.header.get("why", "asked to fail"))
        if msg.kind == "slow":
            t0 = time.perf_counter()
            threading.Event().wait(msg.header["seconds"])  # emulates a long computation, not a synchronisation
            return Message("echoed", {"task": task, "took": time.perf_counter() - t0})
        if msg.kind == "bad_reply":
            return Message("echoed", {"task": task, "n": np.int64(1)})
        if msg.kind == "quiet":
            return None
        return error_reply(msg, f"the echo handler does not handle {msg.kind!r}")


def _log_line(line: str) -> None:
    print(f"echo worker: {line}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the worker the same clean way as Ctrl-C


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("connect")
    parser.add_argument("--protocol", type=int, default=PROTOCOL)
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    return serve(
        args.connect,
        EchoHandler(args.protocol),
        heartbeat_s=args.heartbeat,
        peer_timeout_s=args.timeout,
        welcome_timeout_s=20.0,
        log_line=_log_line,
    )


if __name__ == "__main__":
    sys.exit(main())
