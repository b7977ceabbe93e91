"""Transports: the registry, in-process workers, and ZeroMQ with real worker processes.

Only loopback and ipc:// addresses; every wait has a timeout; every process is reaped.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from backends.numpy_backend import NumpyBackend
from tinyconv.plugins import available_transports, get_transport
from tinyconv.worker import ConvWorker, spawn_local_workers, stop_workers
from transports import PROTOCOL_VERSION, Message, ProtocolError, WorkerLost
from transports.inproc import InprocTransport
from transports.wire import decode, encode
from transports.zmq_transport import EXIT_FAILED, EXIT_OK, ZmqTransport, serve

RNG = np.random.default_rng(3)
X = RNG.standard_normal((2, 3, 8, 8), dtype=np.float32)
W = RNG.standard_normal((6, 3, 3, 3), dtype=np.float32)
B = RNG.standard_normal((6,), dtype=np.float32)
LOCAL = "tcp://127.0.0.1:0"
TIMEOUT = 20.0  # generous upper bounds for busy machines; passing tests return long before


def forward(task, w, b, step=0, layer=0, need_dx=True) -> Message:
    header = {"task": task, "step": step, "layer": layer, "stride": 1, "padding": 1, "need_dx": need_dx}
    return Message("conv_forward", header, {"x": X, "w": w, "b": b})


def backward(task, dy, step=0, layer=0) -> Message:
    return Message("conv_backward", {"task": task, "step": step, "layer": layer}, {"dy": dy})


def recv_all(transport, n: int) -> dict[int, Message]:
    """One reply from each of n workers, by worker index."""
    replies = {}
    while len(replies) < n:
        k, msg = transport.recv(TIMEOUT)
        assert msg.kind == "result", msg.header
        replies[k] = msg
    return replies


def check_sharded_conv(transport, n: int) -> None:
    """Split W's kernels over n workers; the gathered forward and backward equal one direct call."""
    be = NumpyBackend()
    y_ref, cache = be.conv2d_forward(X, W, B, 1, 1)
    dy = RNG.standard_normal(y_ref.shape, dtype=np.float32)
    dx_ref, dw_ref, db_ref = be.conv2d_backward(dy, cache, True)

    cuts = np.linspace(0, W.shape[0], n + 1).astype(int)
    for k in range(n):
        transport.send(k, forward(100 + k, W[cuts[k] : cuts[k + 1]], B[cuts[k] : cuts[k + 1]]))
    ys = recv_all(transport, n)
    np.testing.assert_allclose(np.concatenate([ys[k].arrays["y"] for k in range(n)], axis=1), y_ref, rtol=1e-6)
    assert all(ys[k].header["task"] == 100 + k for k in range(n))

    for k in range(n):
        transport.send(k, backward(200 + k, dy[:, cuts[k] : cuts[k + 1]]))
    gs = recv_all(transport, n)
    dw = np.concatenate([gs[k].arrays["dw"] for k in range(n)])
    db = np.concatenate([gs[k].arrays["db"] for k in range(n)])
    dx = sum(gs[k].arrays["dx"] for k in range(n))
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, db_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)


# ---- registry --------------------------------------------------------------------------


def test_registry_lists_and_builds_transports():
    assert {"inproc", "zmq"} <= set(available_transports())
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'; available: .*inproc.*zmq"):
        get_transport("carrier-pigeon")
    t = get_transport("inproc", handler_factory=lambda i: ConvWorker(NumpyBackend()), bind="ignored")
    assert isinstance(t, InprocTransport)
    with pytest.raises(TypeError, match="handler_factory"):
        get_transport("inproc", handler_factory=None)


# ---- in-process -------------------------------------------------------------------------


def test_inproc_sharded_conv_equals_direct():
    threads_before = threading.active_count()
    made_in = {}

    def factory(i):
        made_in[i] = threading.current_thread().name
        return ConvWorker(NumpyBackend())

    with InprocTransport(factory) as t:
        infos = t.start(3, timeout=TIMEOUT)
        assert [w.index for w in infos] == [0, 1, 2] and all(w.backend == "numpy" for w in infos)
        # each factory call ran in its own worker thread
        assert len(set(made_in.values())) == 3 and threading.current_thread().name not in made_in.values()
        check_sharded_conv(t, 3)
        assert all(s > 0 and r > 0 for s, r in t.traffic().values())
    assert threading.active_count() == threads_before  # close() joined every worker thread


def test_inproc_passes_the_very_same_arrays():
    seen = []

    class Spy:
        def hello(self):
            return ConvWorker(NumpyBackend()).hello()

        def handle(self, msg):
            seen.append(msg.arrays["dy"])
            return None  # no reply

    with InprocTransport(lambda i: Spy()) as t:
        t.start(1, timeout=TIMEOUT)
        dy = np.ones((1, 1, 1, 1), np.float32)
        t.send(0, backward(1, dy))
        with pytest.raises(TimeoutError):
            t.recv(0.2)
        assert seen and seen[0] is dy


def test_inproc_handler_exception_is_an_error_reply_and_worker_keeps_serving():
    class Flaky:
        calls = 0

        def hello(self):
            return ConvWorker(NumpyBackend()).hello()

        def handle(self, msg):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("flaky device")
            return Message("result", {"task": msg.header["task"], "compute_s": 0.0})

    with InprocTransport(lambda i: Flaky()) as t:
        t.start(1, timeout=TIMEOUT)
        t.send(0, backward(41, X))
        k, reply = t.recv(TIMEOUT)
        assert reply.kind == "error" and "flaky device" in reply.header["message"] and reply.header["task"] == 41
        t.send(0, backward(42, X))
        assert t.recv(TIMEOUT)[1].header == {"task": 42, "compute_s": 0.0}


def test_inproc_start_reports_a_factory_failure_and_bad_messages_fail_at_send():
    def factory(i):
        raise RuntimeError("no such GPU")

    with (
        InprocTransport(factory) as t,
        pytest.raises(RuntimeError, match="worker 0 could not start.*no such GPU"),
    ):
        t.start(1, timeout=TIMEOUT)
    with InprocTransport(lambda i: ConvWorker(NumpyBackend())) as t:
        t.start(1, timeout=TIMEOUT)
        with pytest.raises(ProtocolError, match="missing"):
            t.send(0, Message("conv_backward", {"task": 1}, {"dy": X}))
        with pytest.raises(ValueError, match="no worker 5"):
            t.send(5, backward(1, X))
        with pytest.raises(TimeoutError, match="no reply"):
            t.recv(0.05)


# ---- ZeroMQ, master side ------------------------------------------------------------------


def test_zmq_sharded_conv_with_worker_processes_and_clean_shutdown():
    with ZmqTransport(bind=LOCAL, heartbeat_s=0.2, peer_timeout_s=10.0) as t:
        procs = spawn_local_workers(2, t.bound_address, threads=1)
        try:
            infos = t.start(2, timeout=TIMEOUT)
            assert {w.pid for w in infos} == {p.pid for p in procs}
            assert all(w.backend == "numpy" and w.address == "127.0.0.1" for w in infos)
            check_sharded_conv(t, 2)
            sent, received = t.traffic()[0]
            assert sent > X.nbytes and received > X.nbytes  # the input went out, feature maps came back
            t.close()
            t.close()  # idempotent
            for p in procs:  # shutdown reached every worker: each exits 0 by itself
                assert p.wait(timeout=TIMEOUT) == EXIT_OK
        finally:
            stop_workers(procs, timeout=1.0)


def test_zmq_start_without_workers_times_out_with_instructions():
    with ZmqTransport(bind=LOCAL) as t:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            t.start(2, timeout=0.3)
        assert time.monotonic() - t0 < 3.0
        text = str(info.value)
        assert "only 0 of 2 workers said hello within 0.3 s" in text
        assert f"tinyconv worker --connect {t.bound_address}" in text


def test_zmq_bind_failure_is_a_clear_oserror():
    with ZmqTransport(bind=LOCAL) as t, pytest.raises(OSError, match="cannot bind.*no other process"):
        ZmqTransport(bind=t.bound_address)


def raw_dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def recv_msg(sock: zmq.Socket) -> Message:
    assert sock.poll(int(TIMEOUT * 1000)), "nothing arrived"
    return decode(sock.recv_multipart(copy=False))


HELLO = {"protocol": PROTOCOL_VERSION, "backend": "numpy", "device": {}, "pid": 1, "hostname": "test"}


def test_zmq_master_refuses_a_worker_of_another_protocol_version():
    ctx = zmq.Context()
    try:
        with ZmqTransport(bind=LOCAL) as t:
            d = raw_dealer(ctx, t.bound_address)
            future = {"v": PROTOCOL_VERSION + 1, "kind": "hello", "header": HELLO, "arrays": []}
            d.send(msgpack.packb(future))
            with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 1}.*version {PROTOCOL_VERSION}"):
                t.start(1, timeout=TIMEOUT)
            reply = recv_msg(d)  # the worker is told why, too
            assert reply.kind == "error" and "protocol version mismatch" in reply.header["message"]
            d.close()
    finally:
        ctx.term()


def test_zmq_master_reports_malformed_messages_and_turns_away_extra_workers():
    ctx = zmq.Context()
    try:
        with ZmqTransport(bind=LOCAL) as t:
            d = raw_dealer(ctx, t.bound_address)
            d.send_multipart(encode(Message("hello", HELLO)))
            (info,) = t.start(1, timeout=TIMEOUT)
            assert info.hostname == "test" and recv_msg(d).kind == "welcome"
            d.send_multipart([b"\x92garbage"])
            with pytest.raises(ProtocolError, match="worker 0 sent a malformed message"):
                t.recv(TIMEOUT)
            extra = raw_dealer(ctx, t.bound_address)
            extra.send_multipart(encode(Message("hello", HELLO)))
            reply = recv_msg(extra)
            assert reply.kind == "error" and "already has all 1 workers" in reply.header["message"]
            d.send_multipart(encode(Message("result", {"task": 9, "compute_s": 0.5})))
            k, msg = t.recv(TIMEOUT)  # the pool still works
            assert (k, msg.kind, msg.header["task"]) == (0, "result", 9)
            with pytest.raises(TimeoutError):
                t.recv(0.05)
            d.close()
            extra.close()
    finally:
        ctx.term()


def test_zmq_killed_worker_is_lost_within_the_peer_timeout():
    with ZmqTransport(bind=LOCAL, heartbeat_s=0.1, peer_timeout_s=1.0) as t:
        procs = spawn_local_workers(1, t.bound_address, threads=1)
        try:
            t.start(1, timeout=TIMEOUT)
            procs[0].kill()
            procs[0].wait(timeout=TIMEOUT)
            t0 = time.monotonic()
            with pytest.raises(WorkerLost) as info:
                t.recv(5.0)
            assert time.monotonic() - t0 < 1.0 + 1.0 and info.value.worker == 0  # peer timeout + slack
            with pytest.raises(WorkerLost):
                t.send(0, backward(1, X))
        finally:
            stop_workers(procs, timeout=1.0)


class LongBackend(NumpyBackend):
    """A convolution that takes a second: longer than the peer timeouts below."""

    def conv2d_forward(self, *args, **kw):
        threading.Event().wait(1.0)  # emulates a slow device, not a synchronisation
        return super().conv2d_forward(*args, **kw)


def test_heartbeats_flow_while_a_long_task_computes():
    with ZmqTransport(bind=LOCAL, heartbeat_s=0.05, peer_timeout_s=0.4) as t:
        codes: list[int] = []
        worker = ConvWorker(LongBackend())
        th = threading.Thread(
            target=lambda: codes.append(serve(t.bound_address, worker, peer_timeout_s=0.4, quiet=True))
        )
        th.start()
        try:
            t.start(1, timeout=TIMEOUT)
            t.send(0, forward(1, W, B))
            k, reply = t.recv(TIMEOUT)  # no WorkerLost: the worker's I/O loop kept heartbeating
            assert reply.kind == "result" and reply.header["compute_s"] >= 1.0
        finally:
            t.close()
            th.join(timeout=TIMEOUT)
    assert codes == [EXIT_OK]  # and the worker never thought the master was gone


# ---- ZeroMQ, worker side ------------------------------------------------------------------


class FakeMaster:
    """A bare ROUTER that plays the master, to feed a worker exactly the frames a test wants."""

    def __init__(self, bind: str = LOCAL) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, skip_heartbeats: bool = True) -> tuple[bytes, Message]:
        while True:
            assert self.sock.poll(int(TIMEOUT * 1000)), "the worker sent nothing"
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            if not (skip_heartbeats and msg.kind == "heartbeat"):
                return identity, msg

    def send(self, identity: bytes, frames: list) -> None:
        self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def worker_process(address: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tinyconv.worker", "--connect", address, "--threads", "1", *args],
        stderr=subprocess.PIPE,
        text=True,
    )


def test_worker_refused_for_its_protocol_version_exits_with_the_message():
    master = FakeMaster()
    proc = worker_process(master.address)
    try:
        identity, hello = master.recv()
        assert hello.kind == "hello" and hello.header["protocol"] == PROTOCOL_VERSION
        newer = {"v": PROTOCOL_VERSION + 1, "kind": "welcome", "header": {"index": 0}, "arrays": []}
        master.send(identity, [msgpack.packb(newer)])
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == EXIT_FAILED
        assert "refused this worker: protocol version mismatch" in err and "Traceback" not in err
    finally:
        stop_workers([proc], timeout=1.0)
        master.close()


def test_worker_answers_a_bad_message_with_an_error_and_keeps_serving():
    master = FakeMaster()
    proc = worker_process(master.address)
    try:
        identity, _ = master.recv()
        master.send(identity, encode(Message("welcome", {"index": 0, "heartbeat_s": 0.5})))
        declared = {"name": "dy", "dtype": "float32", "shape": [10**12]}
        bogus = {
            "v": PROTOCOL_VERSION,
            "kind": "conv_backward",
            "header": {"task": 1, "step": 0, "layer": 0},
            "arrays": [declared],
        }
        master.send(identity, [msgpack.packb(bogus), b"tiny"])
        _, reply = master.recv()
        assert reply.kind == "error" and "over the limit" in reply.header["message"]
        master.send(identity, encode(Message("result", {"task": 2, "compute_s": 0.0})))
        _, reply = master.recv()
        assert reply.kind == "error" and "does not accept 'result'" in reply.header["message"]
        master.send(identity, encode(forward(3, W, B)))  # still serving
        _, reply = master.recv()
        assert reply.kind == "result" and reply.header["task"] == 3
        master.send(identity, encode(Message("shutdown", {"reason": "train over"})))
        proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == EXIT_OK
    finally:
        stop_workers([proc], timeout=1.0)
        master.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_worker_interrupted_exits_cleanly(sig):
    master = FakeMaster()
    proc = worker_process(master.address)
    try:
        master.recv()  # its hello: the worker is up and serving
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 130 and "interrupted; worker stopping" in err and "Traceback" not in err
    finally:
        stop_workers([proc], timeout=1.0)
        master.close()


def serve_in_thread(address: str, **kw) -> tuple[threading.Thread, list, list]:
    codes: list[int] = []
    lines: list[str] = []
    kw.setdefault("welcome_timeout_s", TIMEOUT)
    th = threading.Thread(
        target=lambda: codes.append(serve(address, ConvWorker(NumpyBackend()), log_line=lines.append, **kw))
    )
    th.start()
    return th, codes, lines


def test_worker_exits_when_the_master_goes_silent():
    master = FakeMaster()
    th, codes, lines = serve_in_thread(master.address, heartbeat_s=0.05, peer_timeout_s=0.5)
    try:
        identity, _ = master.recv()
        master.send(identity, encode(Message("welcome", {"index": 0, "heartbeat_s": 0.05})))
        t0 = time.monotonic()
        th.join(timeout=TIMEOUT)  # the fake master never heartbeats
        assert codes == [EXIT_FAILED] and 0.4 < time.monotonic() - t0 < 5.0
        assert any("master went away" in line for line in lines)
    finally:
        master.close()


def test_worker_stop_event_ends_serve(tmp_path):
    stop = threading.Event()
    th, codes, lines = serve_in_thread(f"ipc://{tmp_path}/nobody.sock", stop=stop)  # no master there
    stop.set()
    th.join(timeout=TIMEOUT)
    assert codes == [130]


def test_ipc_transport_round_trip_zero_copy(tmp_path):
    with ZmqTransport(bind=f"ipc://{tmp_path}/master.sock", heartbeat_s=0.2) as t:
        assert t.bound_address.startswith("ipc://")
        th, codes, lines = serve_in_thread(t.bound_address, quiet=True)
        try:
            t.start(1, timeout=TIMEOUT)
            # big enough that zmq gives the array its own buffer; tiny frames share (and may
            # misalign in) zmq's receive buffer, and the decoder then copies them to align
            x = RNG.standard_normal((4, 3, 16, 16), dtype=np.float32)
            msg = forward(1, W, B)
            msg.arrays["x"] = x
            t.send(0, msg)
            _, reply = t.recv(TIMEOUT)
            y = reply.arrays["y"]
            assert not y.flags.owndata and not y.flags.writeable  # a view of the received frame
            np.testing.assert_allclose(y, NumpyBackend().conv2d_forward(x, W, B, 1, 1)[0], rtol=1e-6)
        finally:
            t.close()
            th.join(timeout=TIMEOUT)
    assert codes == [EXIT_OK] and lines == []
