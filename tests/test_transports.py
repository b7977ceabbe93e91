"""Transports on their own: the registry, in-process workers, ZeroMQ with real worker processes.

The tasks are the tests' own (``tests/echo_worker.py``): kinds the transports never
heard of, which they must carry all the same. Only loopback and ipc:// addresses;
every wait has a timeout; every process is reaped. CURVE is in test_curve.py, workers
that come and go in test_membership.py, memory under a flood in test_transport_memory.py.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from echo_worker import PROTOCOL, TIMEOUT, EchoHandler, answer, reap, spawn
from transport_conformance import (
    X,
    check_bad_messages_fail_at_send,
    check_echoes,
    check_error_replies,
    check_exact_arrays,
    echo,
)

from transports import (
    WIRE_VERSION,
    Message,
    ProtocolError,
    VersionMismatch,
    available_transports,
    get_transport,
    load_transport,
)
from transports.base import WorkerLost
from transports.inproc import InprocTransport
from transports.session.settings import SECRET_ENV
from transports.wire import PROGRESS, decode, encode
from transports.zmq_master import ZmqTransport
from transports.zmq_worker import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, serve

RNG = np.random.default_rng(3)
LOCAL = "tcp://127.0.0.1:0"
# X, echo() and the check_* functions are in transport_conformance.py: what every transport must do,
# run here on inproc and zmq and in test_mpi.py on mpi.


# ---- registry and constructors --------------------------------------------------------------


def test_registry_lists_and_builds_transports():
    assert {"inproc", "zmq"} <= set(available_transports())
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'; available: .*inproc.*zmq"):
        get_transport("carrier-pigeon")
    assert load_transport("zmq") is ZmqTransport
    with get_transport("inproc", handler_factory=lambda i: EchoHandler(), protocol=PROTOCOL, bind="ignored") as t:
        assert isinstance(t, InprocTransport)
    with pytest.raises(TypeError, match="handler_factory"):
        get_transport("inproc", handler_factory=None, protocol=PROTOCOL)


def test_transports_need_the_task_protocol_version():
    with pytest.raises(TypeError, match="protocol"):
        InprocTransport(lambda i: EchoHandler())
    with pytest.raises(TypeError, match="protocol must be an int"):
        InprocTransport(lambda i: EchoHandler(), protocol=True)
    with pytest.raises(TypeError, match="protocol"):
        ZmqTransport(bind=LOCAL)
    with pytest.raises(TypeError, match="protocol must be an int"):
        ZmqTransport(bind=LOCAL, protocol="7")


# ---- in-process -------------------------------------------------------------------------


def test_inproc_echoes_on_every_worker():
    threads_before = threading.active_count()
    made_in = {}

    def factory(i):
        made_in[i] = threading.current_thread().name
        return EchoHandler()

    with InprocTransport(factory, protocol=PROTOCOL) as t:
        infos = t.start(3, timeout=TIMEOUT)
        assert [w.index for w in infos] == [0, 1, 2] and all(w.backend == "echo" for w in infos)
        # each factory call ran in its own worker thread
        assert len(set(made_in.values())) == 3 and threading.current_thread().name not in made_in.values()
        check_echoes(t, 3)
        assert all(s > 0 and r > 0 for s, r in t.traffic().values())
    assert threading.active_count() == threads_before  # close() joined every worker thread


def test_inproc_passes_the_very_same_arrays():
    seen = []

    class Spy(EchoHandler):
        def handle(self, msg):
            seen.append(msg.arrays.get("x"))
            return super().handle(msg) if msg.kind == "quiet" else Message("echoed", {}, {"y": msg.arrays["x"]})

    with InprocTransport(lambda i: Spy(), protocol=PROTOCOL) as t:
        t.start(1, timeout=TIMEOUT)
        x = np.ones((1, 1), np.float32)
        t.send(0, Message("quiet"))  # no reply to this one
        t.send(0, echo(1, x))
        k, reply = answer(t)
        assert seen == [None, x] and seen[1] is x and reply.arrays["y"] is x
        with pytest.raises(TimeoutError):
            t.recv(0.05)


def test_inproc_handler_exception_is_an_error_reply_and_worker_keeps_serving():
    with InprocTransport(lambda i: EchoHandler(), protocol=PROTOCOL) as t:
        t.start(1, timeout=TIMEOUT)
        check_error_replies(t)
        check_exact_arrays(t)


def test_inproc_refuses_a_worker_of_another_protocol():
    with InprocTransport(lambda i: EchoHandler(protocol=PROTOCOL + 1), protocol=PROTOCOL) as t:
        with pytest.raises(VersionMismatch) as info:
            t.start(1, timeout=TIMEOUT)
    assert str(info.value).startswith(
        f"task protocol version mismatch: in-process worker 0 speaks version {PROTOCOL + 1}, "
        f"the master version {PROTOCOL}"
    )


def test_inproc_start_reports_a_factory_failure_and_bad_messages_fail_at_send():
    def factory(i):
        raise RuntimeError("no such GPU")

    with (
        InprocTransport(factory, protocol=PROTOCOL) as t,
        pytest.raises(RuntimeError, match="worker 0 could not start.*no such GPU"),
    ):
        t.start(1, timeout=TIMEOUT)
    with InprocTransport(lambda i: EchoHandler(), protocol=PROTOCOL) as t:
        t.start(1, timeout=TIMEOUT)
        # what zmq could not send, inproc refuses too: numpy scalars, tuples, bad session headers, bad kinds
        check_bad_messages_fail_at_send(t)
        with pytest.raises(TimeoutError, match="no reply"):
            t.recv(0.05)


# ---- ZeroMQ, master side ------------------------------------------------------------------


def test_zmq_echoes_with_worker_processes_and_clean_shutdown():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, heartbeat_s=0.2) as t:
        procs = [spawn(t.bound_address) for _ in range(2)]
        try:
            infos = t.start(2, timeout=TIMEOUT)
            assert {w.pid for w in infos} == {p.pid for p in procs}
            assert all(w.backend == "echo" and w.address == "127.0.0.1" for w in infos)
            assert infos[0].device == {"name": "test device", "hellos": 1}
            check_echoes(t, 2)
            check_exact_arrays(t, 1)
            check_error_replies(t, 0)
            check_bad_messages_fail_at_send(t)
            sent, received = t.traffic()[0]
            assert sent > X.nbytes and received > X.nbytes  # the input went out, the output came back
            t.close()
            t.close()  # idempotent
            for p in procs:  # shutdown reached every worker: each exits 0 by itself
                _, err = p.communicate(timeout=TIMEOUT)
                assert p.returncode == EXIT_OK and "shutdown: train over" in err and "Traceback" not in err
        finally:
            reap(procs)


def test_zmq_start_without_workers_times_out_with_instructions():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            t.start(2, timeout=0.3)
        assert time.monotonic() - t0 < 3.0
        text = str(info.value)
        assert "only 0 of 2 workers said hello within 0.3 s" in text
        assert f"start workers that connect to {t.bound_address}" in text


def test_zmq_bind_failure_is_a_clear_oserror():
    with (
        ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t,
        pytest.raises(OSError, match="cannot bind.*no other process"),
    ):
        ZmqTransport(bind=t.bound_address, protocol=PROTOCOL)


def raw_dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def recv_msg(sock: zmq.Socket) -> Message:
    assert sock.poll(int(TIMEOUT * 1000)), "nothing arrived"
    return decode(sock.recv_multipart(copy=False))


HELLO = EchoHandler().hello()


def test_zmq_master_tells_a_worker_of_another_wire_version_and_waits_on():
    ctx = zmq.Context()
    try:
        with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
            d = raw_dealer(ctx, t.bound_address)
            future = {"v": WIRE_VERSION + 1, "kind": "hello", "header": HELLO, "arrays": []}
            d.send(msgpack.packb(future))
            reply = recv_msg(d)  # the worker is told why
            theirs, ours = WIRE_VERSION + 1, WIRE_VERSION
            both = f"wire version mismatch: the worker speaks version {theirs}, the master version {ours}"
            assert reply.kind == "error" and both in reply.header["message"]
            with pytest.raises(TimeoutError, match="only 0 of 1 workers"):  # and the master still waits
                t.start(1, timeout=0.2)
            d.close()
    finally:
        ctx.destroy(linger=0)  # closes what an assertion left open: a failure, never a hang


def test_zmq_worker_of_another_task_protocol_is_refused_and_the_master_keeps_waiting():
    both = f"task protocol version mismatch: the worker speaks version {PROTOCOL + 1}, the master version {PROTOCOL}"
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
        wrong = spawn(t.bound_address, "--protocol", str(PROTOCOL + 1))
        try:
            _, err = wrong.communicate(timeout=TIMEOUT)  # refused: it exits, and says why
            assert wrong.returncode == EXIT_FAILED and "Traceback" not in err
            assert f"refused this worker: {both}" in err
            good = spawn(t.bound_address)
            (info,) = t.start(1, timeout=TIMEOUT)  # the refusal did not end the master's wait
            assert info.pid == good.pid
        finally:
            t.close()
            reap([wrong, good])


def test_an_ipc_socket_is_for_this_user_alone(tmp_path):
    path = tmp_path / "workers.sock"
    with ZmqTransport(bind=f"ipc://{path}", protocol=PROTOCOL):
        assert path.stat().st_mode & 0o777 == 0o600


def test_a_master_with_a_join_secret_admits_only_the_workers_given_it():
    # what another local user's process meets on loopback: a refusal, and the master waits on for its own
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, secret="this run's") as t:
        stranger = spawn(t.bound_address)
        wrong = spawn(t.bound_address, env={SECRET_ENV: "a guess"})
        try:
            for p in (stranger, wrong):
                _, err = p.communicate(timeout=TIMEOUT)
                assert (
                    p.returncode == EXIT_FAILED and "admits only the workers it started or gave its join secret" in err
                ), err
            own = spawn(t.bound_address, env={SECRET_ENV: "this run's"})
            (info,) = t.start(1, timeout=TIMEOUT)
            assert info.pid == own.pid
        finally:
            t.close()
            reap([stranger, wrong, own])


def test_zmq_master_reports_malformed_messages_and_admits_extra_workers_later():
    ctx = zmq.Context()
    try:
        with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
            d = raw_dealer(ctx, t.bound_address)
            d.send_multipart(encode(Message("hello", HELLO)))
            (info,) = t.start(1, timeout=TIMEOUT)
            assert info.pid == os.getpid() and recv_msg(d).kind == "welcome"
            d.send_multipart([b"\x92garbage"])
            with pytest.raises(ProtocolError, match="worker 0 sent a malformed message"):
                t.recv(TIMEOUT)
            reply = recv_msg(d)  # and the worker is told
            assert reply.kind == "error" and "could not read your message" in reply.header["message"]
            extra = raw_dealer(ctx, t.bound_address)
            extra.send_multipart(encode(Message("hello", HELLO)))
            reply = recv_msg(extra)  # one more worker is welcome, under the next index
            assert reply.kind == "welcome" and reply.header["index"] == 1
            assert [w.index for w in t.joined()] == [1] and t.joined() == []
            # the session's own kinds stop at the transport; a reply of any other kind, and errors, reach recv
            d.send_multipart(encode(Message("heartbeat")))
            d.send_multipart(encode(Message("welcome", {"index": 0, "heartbeat_s": 1.0})))
            d.send_multipart(encode(Message("made_up_reply", {"task": 9, "anything": [1, "two"]})))
            d.send_multipart(encode(Message("error", {"message": "out of memory", "task": 10})))
            k, msg = t.recv(TIMEOUT)  # the pool still works
            assert (k, msg.kind, msg.header) == (0, "made_up_reply", {"task": 9, "anything": [1, "two"]})
            k, msg = t.recv(TIMEOUT)
            assert (k, msg.kind, msg.header) == (0, "error", {"message": "out of memory", "task": 10})
            with pytest.raises(TimeoutError):
                t.recv(0.05)
            d.close()
            extra.close()
    finally:
        ctx.destroy(linger=0)  # closes what an assertion left open: a failure, never a hang


def serve_in_thread(address: str, handler=None, **kw) -> tuple[threading.Thread, list, list]:
    codes: list[int] = []
    lines: list[str] = []
    kw.setdefault("welcome_timeout_s", TIMEOUT)
    handler = handler or EchoHandler()
    th = threading.Thread(target=lambda: codes.append(serve(address, handler, log_line=lines.append, **kw)))
    th.start()
    return th, codes, lines


def test_heartbeats_flow_while_a_long_task_computes():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, heartbeat_s=0.1, peer_timeout_s=0.4) as t:
        th, codes, lines = serve_in_thread(t.bound_address, peer_timeout_s=0.4, quiet=True)
        try:
            t.start(1, timeout=TIMEOUT)
            t.send(0, Message("slow", {"task": 1, "seconds": 1.0}))  # longer than either side's patience
            k, reply = answer(t)  # no WorkerLost: the worker's I/O loop kept heartbeating
            assert reply.kind == "echoed" and reply.header["took"] >= 1.0
        finally:
            t.close()
            th.join(timeout=TIMEOUT)
    assert codes == [EXIT_OK] and lines == []  # and the worker never thought the master was gone


def test_a_worker_the_runtime_dropped_hears_nothing_more_and_comes_back_as_a_joiner():
    # what the runtime asks of the transport for a worker past its deadline whose link still lives
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, heartbeat_s=0.1, peer_timeout_s=0.4) as t:
        th, codes, lines = serve_in_thread(t.bound_address, peer_timeout_s=0.4, quiet=True)
        try:
            (info,) = t.start(1, timeout=TIMEOUT)
            assert t.drop(0, "no result within 2 x its expected 0.1 s of compute + 1 s")
            with pytest.raises(WorkerLost, match="no result within 2 x"):
                t.send(0, Message("echo", {"task": 1}))
            deadline = time.monotonic() + TIMEOUT  # the worker misses the master's heartbeats and says hello again
            while not (back := t.joined()):
                assert time.monotonic() < deadline, "the dropped worker never came back"
                time.sleep(0.02)
            assert [(w.index, w.pid) for w in back] == [(1, info.pid)]
            t.send(1, Message("echo", {"task": 2}))
            assert answer(t)[0] == 1
        finally:
            t.close()
            th.join(timeout=TIMEOUT)


def test_ipc_transport_round_trip_zero_copy(tmp_path):
    with ZmqTransport(bind=f"ipc://{tmp_path}/master.sock", protocol=PROTOCOL, heartbeat_s=0.2) as t:
        assert t.bound_address.startswith("ipc://")
        th, codes, lines = serve_in_thread(t.bound_address, quiet=True)
        try:
            t.start(1, timeout=TIMEOUT)
            # big enough that zmq gives the array its own buffer; tiny frames share (and may
            # misalign in) zmq's receive buffer, and the decoder then copies them to align
            x = RNG.standard_normal((4, 3, 16, 16), dtype=np.float32)
            t.send(0, echo(1, x))
            _, reply = answer(t)
            y = reply.arrays["y"]
            assert not y.flags.owndata and not y.flags.writeable  # a view of the received frame
            np.testing.assert_array_equal(y, x * 2 + 1)
        finally:
            t.close()
            th.join(timeout=TIMEOUT)
    assert codes == [EXIT_OK] and lines == []


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
        """The next message but, with ``skip_heartbeats``, heartbeats and a task's progress."""
        while True:
            assert self.sock.poll(int(TIMEOUT * 1000)), "the worker sent nothing"
            identity, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            if not (skip_heartbeats and msg.kind in {"heartbeat", *PROGRESS}):
                return identity, msg

    def send(self, identity: bytes, frames: list) -> None:
        self.sock.send_multipart([identity, *frames])

    def close(self) -> None:
        self.sock.close()
        self.ctx.destroy(linger=0)


def test_worker_refused_for_its_wire_version_exits_with_the_message():
    master = FakeMaster()
    proc = spawn(master.address)
    try:
        identity, hello = master.recv()
        assert hello.kind == "hello" and hello.header["protocol"] == PROTOCOL
        newer = {"v": WIRE_VERSION + 1, "kind": "welcome", "header": {"index": 0}, "arrays": []}
        master.send(identity, [msgpack.packb(newer)])
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == EXIT_FAILED and "Traceback" not in err
        assert (
            f"wire version mismatch: the master speaks version {WIRE_VERSION + 1}, this worker version {WIRE_VERSION}"
            in err
        )
    finally:
        reap([proc])
        master.close()


def test_worker_answers_a_bad_message_with_an_error_and_keeps_serving():
    master = FakeMaster()
    proc = spawn(master.address)
    try:
        identity, _ = master.recv()
        master.send(identity, encode(Message("welcome", {"index": 0, "heartbeat_s": 0.5})))
        declared = {"name": "x", "dtype": "float32", "shape": [10**12]}
        bogus = {"v": WIRE_VERSION, "kind": "echo", "header": {"task": 1}, "arrays": [declared]}
        master.send(identity, [msgpack.packb(bogus), b"tiny"])
        _, reply = master.recv()
        assert reply.kind == "error" and "over the limit" in reply.header["message"]
        master.send(identity, encode(Message("hello", HELLO)))  # a session kind no worker takes
        _, reply = master.recv()
        assert reply.kind == "error" and "does not accept 'hello'" in reply.header["message"]
        master.send(identity, encode(Message("frobnicate", {"task": 2})))  # a task the handler does not know
        _, reply = master.recv()
        assert reply.header == {"message": "the echo handler does not handle 'frobnicate'", "task": 2}
        master.send(identity, encode(Message("fail", {"task": 3})))
        _, reply = master.recv()
        assert reply.header == {"message": "fail failed: RuntimeError: asked to fail", "task": 3}
        master.send(identity, encode(echo(4)))  # still serving
        _, reply = master.recv()
        assert reply.kind == "echoed" and reply.header["task"] == 4
        master.send(identity, encode(Message("shutdown", {"reason": "train over"})))
        proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == EXIT_OK
    finally:
        reap([proc])
        master.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_worker_interrupted_exits_cleanly(sig):
    master = FakeMaster()
    proc = spawn(master.address)
    try:
        master.recv()  # its hello: the worker is up and serving
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == EXIT_INTERRUPTED and "Traceback" not in err
        assert "interrupted; worker stopping" in err
    finally:
        reap([proc])
        master.close()


def test_worker_exits_when_the_master_goes_silent_and_none_comes_back_within_retry_for():
    master = FakeMaster()
    th, codes, lines = serve_in_thread(master.address, heartbeat_s=0.05, peer_timeout_s=0.5, retry_for=0.5, quiet=True)
    try:
        identity, _ = master.recv()
        master.send(identity, encode(Message("welcome", {"index": 0, "heartbeat_s": 0.05})))
        t0 = time.monotonic()
        th.join(timeout=TIMEOUT)  # the fake master never heartbeats, nor answers the hellos that follow
        assert codes == [EXIT_FAILED] and 0.6 < time.monotonic() - t0 < 5.0  # a patience of 0.2 s, then 0.5 s
        assert re.fullmatch(
            r"lost the master: silent for [\d.]+ s \(patience 0\.2 s: 4 heartbeats; at most 0\.5 s\)", lines[0]
        )
        assert lines[1] == f"saying hello again to {master.address} for up to 0.5 s"
        assert lines[-1].startswith(f"master went away: no master at {master.address} for 0.5 s")
    finally:
        master.close()


def test_worker_with_retry_for_zero_exits_when_the_master_goes_silent():
    master = FakeMaster()
    th, codes, lines = serve_in_thread(master.address, heartbeat_s=0.05, peer_timeout_s=0.3, retry_for=0, quiet=True)
    try:
        identity, _ = master.recv()
        master.send(identity, encode(Message("welcome", {"index": 0, "heartbeat_s": 0.05})))
        th.join(timeout=TIMEOUT)
        assert codes == [EXIT_FAILED] and lines[-1] == "master went away; worker exiting"
    finally:
        master.close()


def test_worker_stop_event_ends_serve(tmp_path):
    stop = threading.Event()
    th, codes, lines = serve_in_thread(f"ipc://{tmp_path}/nobody.sock", stop=stop)  # no master there
    stop.set()
    th.join(timeout=TIMEOUT)
    assert codes == [EXIT_INTERRUPTED]


def test_a_refused_worker_is_told_and_turned_away_for_a_time_that_doubles():
    # what the runtime asks of the transport for a worker whose answers were wrong (tinyconv's spot check)
    ctx = zmq.Context()
    try:
        with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
            d = raw_dealer(ctx, t.bound_address)
            d.send_multipart(encode(Message("hello", HELLO)))
            (info,) = t.start(1, timeout=TIMEOUT)
            assert recv_msg(d).kind == "welcome" and t.refuse(0, "wrong result: off by 99")
            bye = recv_msg(d)
            assert bye.kind == "shutdown" and bye.header["reason"] == "refused for 60 s: wrong result: off by 99"
            with pytest.raises(WorkerLost, match="refused: wrong result"):
                t.send(0, Message("echo", {"task": 1}))
            again = raw_dealer(ctx, t.bound_address)  # back at once, from the same address
            again.send_multipart(encode(Message("hello", HELLO)))
            told = recv_msg(again)
            assert (
                told.kind == "error" and "refuses this worker for another 60 s: wrong result" in told.header["message"]
            )
            assert t.joined() == []
            assert t._io.admission.refuse(0, "wrong again", time.monotonic()) == 120.0  # the next refusal: twice
    finally:
        ctx.destroy(linger=0)
