"""A tiny handler for the transport tests, and a worker process that serves it over ZeroMQ.

The transports know nothing of the tasks they carry, so they are tested with tasks
of their own: ``echo`` (its ``x`` comes back as ``y = 2 x + 1``), ``fail`` (the
handler raises), ``slow`` (it computes for ``seconds``), ``bad_reply`` (the reply
holds a numpy scalar), ``quiet`` (no reply). Anything else is answered by an error.

    python tests/echo_worker.py CONNECT [--protocol N] [--heartbeat S] [--timeout S] [--connect-timeout S]
        [--retry-for S] [--forever] [--secret-key FILE --server-key FILE]

runs :func:`transports.zmq_worker.serve` with it (CURVE with the two key files) and
exits with serve's code. The handler counts its hellos (``device["hellos"]``), so a
test can tell that a worker said hello afresh to each new master. Only :func:`main` needs
pyzmq, so the MPI tests import the handler where pyzmq is forbidden.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from transports.base import Message
from transports.wire import PROGRESS, error_reply

PROTOCOL = 7  # the task protocol these tests speak
TIMEOUT = 20.0  # the tests' generous upper bound for anything to happen; passing tests return long before
HERE = Path(__file__).resolve().parent


class EchoHandler:
    """The worker side of the tests' task protocol (see the module docstring)."""

    def __init__(self, protocol: int = PROTOCOL) -> None:
        self.protocol = protocol
        self.hellos = 0

    def hello(self) -> dict[str, Any]:
        self.hellos += 1
        return {
            "protocol": self.protocol,
            "backend": "echo",
            "device": {"name": "test device", "hellos": self.hellos},
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


def spawn(address: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real worker process: this file serving the echo handler at ``address`` (stderr captured), with
    ``env`` added to the environment."""
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, str(HERE / "echo_worker.py"), address, *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )


def reap(procs: list[subprocess.Popen]) -> None:
    """Kill what still runs (continuing a stopped one first) and wait for every process."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.communicate(timeout=TIMEOUT)


def read_stderr_until(proc: subprocess.Popen, text: str, timeout: float = TIMEOUT) -> str:
    """Read ``proc``'s stderr until ``text`` appears; return everything read (communicate() gets the rest)."""
    fd, seen = proc.stderr.fileno(), ""
    deadline = time.monotonic() + timeout
    while text not in seen:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the worker did not say {text!r} within {timeout:g} s; it said {seen!r}"
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"the worker exited ({proc.wait()}) before saying {text!r}; it said {seen!r}"
            seen += chunk.decode()
    return seen


def answer(transport, timeout: float = TIMEOUT) -> tuple[int, Message]:
    """The next message from ``transport`` past the ``started`` and ``computed`` a worker says of each task: a
    reply, an error."""
    while True:
        k, msg = transport.recv(timeout)
        if msg.kind not in PROGRESS:
            return k, msg


def wait_for(condition: Callable[[], Any], timeout: float = TIMEOUT, what: str = "the condition") -> Any:
    """Poll ``condition`` until it returns something truthy, which is returned; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        pause.wait(0.01)


def _log_line(line: str) -> None:
    print(f"echo worker: {line}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the worker the same clean way as Ctrl-C


def main() -> int:
    from transports.curve import CurveClient  # here, not above: the MPI tests use this module without pyzmq
    from transports.zmq_worker import serve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("connect")
    parser.add_argument("--protocol", type=int, default=PROTOCOL)
    parser.add_argument("--heartbeat", type=float, default=0.4)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--connect-timeout", type=float, default=20.0)
    parser.add_argument("--retry-for", type=float, default=600.0)
    parser.add_argument("--forever", action="store_true")
    parser.add_argument("--secret-key", help="this worker's NAME.key_secret file")
    parser.add_argument("--server-key", help="the master's public NAME.key file")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID prints every thread's stack
    curve = CurveClient(args.secret_key, args.server_key) if args.secret_key else None
    return serve(
        args.connect,
        EchoHandler(args.protocol),
        heartbeat_s=args.heartbeat,
        peer_timeout_s=args.timeout,
        welcome_timeout_s=args.connect_timeout,
        log_line=_log_line,
        curve=curve,
        retry_for=args.retry_for,
        forever=args.forever,
    )


if __name__ == "__main__":
    sys.exit(main())
