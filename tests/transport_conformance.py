"""What every transport must do, as checks that take a started transport of echo workers.

``tests/test_transports.py`` runs them on the in-process and ZeroMQ transports,
``tests/test_mpi.py`` on the MPI one (inside an ``mpiexec`` job). The workers serve
``tests/echo_worker.py``'s :class:`EchoHandler`; its task kinds are the tests' own, which
no transport has heard of and every transport must carry all the same.
"""

from __future__ import annotations

import numpy as np
import pytest
from echo_worker import TIMEOUT, answer

from transports import SESSION_KINDS, Message, ProtocolError

X = np.random.default_rng(3).standard_normal((2, 3, 8), dtype=np.float32)


def echo(task: int, x: np.ndarray = X, **extra) -> Message:
    return Message("echo", {"task": task, **extra}, {"x": x})


def check_echoes(transport, n: int) -> None:
    """One echo to each of n workers, each with its own input and header; each reply answers its own."""
    assert "echo" not in SESSION_KINDS and "echoed" not in SESSION_KINDS  # kinds the transport never heard of
    headers = {k: {"task": 100 + k, "note": f"to {k}", "nested": {"list": [1, 2.5, None, True]}} for k in range(n)}
    for k in range(n):
        transport.send(k, Message("echo", headers[k], {"x": X + k}))
    replies = {}
    while len(replies) < n:
        k, msg = answer(transport)
        assert msg.kind == "echoed", msg.header
        replies[k] = msg
    for k, msg in replies.items():
        assert msg.header == {"task": 100 + k, "seen": headers[k]}
        np.testing.assert_array_equal(msg.arrays["y"], (X + k) * 2 + 1)


def check_exact_arrays(transport, k: int = 0) -> None:
    """Every dtype the wire carries comes back bit for bit: odd shapes, one element, empty, and one large
    enough to leave a transport's small-message path (4 MB)."""
    rng = np.random.default_rng(5)
    arrays = [
        rng.standard_normal((4, 3, 17, 5), dtype=np.float32),
        rng.integers(-(2**31), 2**31 - 1, (7, 3), dtype=np.int32),
        rng.integers(-(2**40), 2**40, (5,), dtype=np.int64),
        rng.integers(0, 100, (3, 1, 2), dtype=np.uint8),  # 2x+1 stays below 256
        np.array([1.5], np.float32),
        np.zeros((0, 4), np.float32),
        rng.standard_normal((16, 64, 32, 32), dtype=np.float32),
    ]
    for i, x in enumerate(arrays):
        transport.send(k, echo(200 + i, x))
        said = [transport.recv(TIMEOUT) for _ in range(2)]  # the worker's word on the task, before its reply
        assert said == [(k, Message("started", {"task": 200 + i})), (k, Message("computed", {"task": 200 + i}))]
        got, reply = transport.recv(TIMEOUT)
        assert (got, reply.kind, reply.header["task"]) == (k, "echoed", 200 + i), reply.header
        y = reply.arrays["y"]
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(y, x * 2 + 1)


def check_error_replies(transport, k: int = 0) -> None:
    """A handler's exception, and a reply that breaks the wire, are error replies naming the task;
    the worker keeps serving."""
    transport.send(k, Message("fail", {"task": 41, "why": "flaky device"}))
    got, reply = answer(transport)
    assert (got, reply.kind) == (k, "error") and reply.header["task"] == 41
    assert reply.header["message"] == "fail failed: RuntimeError: flaky device"
    transport.send(k, Message("bad_reply", {"task": 42}))
    _, reply = answer(transport)
    assert reply.kind == "error" and reply.header["task"] == 42
    assert "invalid reply" in reply.header["message"] and "numpy scalar" in reply.header["message"]
    transport.send(k, Message("frobnicate", {"task": 43}))  # a task the handler does not know
    _, reply = answer(transport)
    assert reply.header == {"message": "the echo handler does not handle 'frobnicate'", "task": 43}
    transport.send(k, Message("quiet", {"task": 44}))  # no reply to this one...
    transport.send(k, echo(45))  # ... and the worker still serves
    got, reply = answer(transport)
    assert (got, reply.kind, reply.header["task"]) == (k, "echoed", 45)


def check_bad_messages_fail_at_send(transport) -> None:
    """What the wire cannot carry is refused in the caller, at send, whatever the transport; so is an
    unknown worker; and a receive with nothing to receive times out."""
    with pytest.raises(ProtocolError, match=r"header\['task'\] is not plain data: a numpy.int64"):
        transport.send(0, echo(np.int64(1)))
    with pytest.raises(ProtocolError, match=r"header\['n'\] is not plain data: a numpy.float64"):
        transport.send(0, echo(1, n=np.float64(0.5)))  # a subclass of float, which msgpack would take
    with pytest.raises(ProtocolError, match="a tuple"):
        transport.send(0, echo(1, span=(0, 2)))
    with pytest.raises(ProtocolError, match="shutdown: header is missing 'reason'"):
        transport.send(0, Message("shutdown"))
    with pytest.raises(ProtocolError, match="not a short identifier"):
        transport.send(0, Message("Echo"))
    with pytest.raises(ProtocolError, match="dtype float64"):
        transport.send(0, echo(1, np.zeros(2)))
    with pytest.raises(ValueError, match="no worker 5"):
        transport.send(5, echo(1))
    with pytest.raises(TimeoutError, match="within 0.05 s"):
        transport.recv(0.05)
