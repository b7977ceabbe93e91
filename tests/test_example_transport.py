"""The guide's example transport (``tests/example_transport.py``, shown whole in docs/writing-a-transport.md):
it passes the checks every transport passes, and it is the very code the guide shows."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from echo_worker import PROTOCOL, TIMEOUT, EchoHandler
from example_transport import Stream, TcpTransport, serve
from transport_conformance import check_bad_messages_fail_at_send, check_echoes, check_error_replies, check_exact_arrays

from transports import Message, WorkerLost
from transports.session.settings import EXIT_OK
from transports.wire import encode

HERE = Path(__file__).resolve().parent
GUIDE = HERE.parent / "docs" / "writing-a-transport.md"
SHOWN = "`tests/example_transport.py`, whole:\n\n```python\n"  # what comes right before the code in the guide


def test_the_guide_shows_the_example_transport_whole():
    guide = GUIDE.read_text()
    assert SHOWN in guide
    shown = guide.split(SHOWN, 1)[1].split("\n```\n", 1)[0] + "\n"
    assert shown == (HERE / "example_transport.py").read_text()


def test_the_example_transport_passes_the_conformance_checks():
    codes: dict[int, int] = {}
    lines: list[str] = []
    with TcpTransport(protocol=PROTOCOL, heartbeat_s=0.2) as t:

        def work(i: int) -> None:
            codes[i] = serve(t.bound_address, EchoHandler(), heartbeat_s=0.2, say=lines.append, info=lines.append)

        workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
        for w in workers:
            w.start()
        infos = t.start(2, timeout=TIMEOUT)
        assert [w.index for w in infos] == [0, 1] and all(w.backend == "echo" for w in infos)
        check_echoes(t, 2)
        check_exact_arrays(t, 1)
        check_error_replies(t, 0)
        check_bad_messages_fail_at_send(t)
        sent, received = t.traffic()[1]
        assert sent > 4 << 20 and received > 4 << 20  # the large array went out and came back
        t.close()
        for w in workers:
            w.join(TIMEOUT)
    assert codes == {0: EXIT_OK, 1: EXIT_OK}, lines
    assert lines.count("shutdown: train over") == 2


def test_a_worker_whose_connection_closes_is_lost_at_once():
    with TcpTransport(protocol=PROTOCOL, peer_timeout_s=TIMEOUT) as t:
        host, port = t.bound_address.rsplit(":", 1)
        stream = Stream(socket.create_connection((host, int(port))), 1 << 20)
        stream.send(encode(Message("hello", EchoHandler().hello())))
        t.start(1, timeout=TIMEOUT)
        stream.sock.close()
        with pytest.raises(WorkerLost, match=r"worker 0 lost: (?!silent)"):  # it is gone, not silent
            t.recv(TIMEOUT)


def test_any_bytes_keep_a_worker_alive_not_only_heartbeats():
    """A worker whose large reply trickles in for twice its patience's ceiling, with no heartbeat, is not lost:
    every sign of life counts (the session's liveness, apart from bulk data)."""
    pace = threading.Event()  # never set: its wait paces the trickle, as a slow link would
    with TcpTransport(protocol=PROTOCOL, heartbeat_s=0.1, peer_timeout_s=0.5) as t:
        host, port = t.bound_address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        Stream(sock, 1 << 20).send(encode(Message("hello", EchoHandler().hello())))
        t.start(1, timeout=TIMEOUT)
        frames = encode(Message("echoed", {"task": 1}, {"y": np.arange(1000, dtype=np.float32)}))
        lengths = [len(bytes(f)) for f in frames]
        wire_bytes = struct.pack(f"!I{len(frames)}Q", len(frames), *lengths) + b"".join(bytes(f) for f in frames)
        deadline = time.monotonic() + 1.0  # twice the ceiling
        for i in range(0, len(wire_bytes), 100):
            sock.sendall(wire_bytes[i : i + 100])
            pace.wait(max(0.0, (deadline - time.monotonic()) / max(1, (len(wire_bytes) - i) // 100)))
        k, reply = t.recv(TIMEOUT)  # no WorkerLost first
        assert (k, reply.kind, reply.header) == (0, "echoed", {"task": 1})
        np.testing.assert_array_equal(reply.arrays["y"], np.arange(1000, dtype=np.float32))
        sock.close()
