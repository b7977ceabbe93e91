"""Workers that come and go, and a master that is not stopped by strangers before admission.

Real worker processes (``tests/echo_worker.py``) on loopback or ipc://. Nothing sleeps to
synchronise: each test waits, with a timeout, on what it expects (a WorkerLost, a line
from the worker, a log record, joined() reporting someone). The two detection tests run
with the default heartbeat (0.4 s: a stopped peer's patience is 4 of them) and print what they measured.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from echo_worker import PROTOCOL, TIMEOUT, EchoHandler, answer, read_stderr_until, reap, spawn, wait_for

from transports.base import Message, WorkerLost
from transports.droplog import DropLog
from transports.pieces import pieces
from transports.wire import MAX_HEADER_BYTES, WIRE_VERSION, ProtocolError, decode, encode
from transports.zmq_master import ZmqTransport
from transports.zmq_worker import EXIT_INTERRUPTED, EXIT_OK

LOCAL = "tcp://127.0.0.1:0"
FAST = {"heartbeat_s": 0.1, "peer_timeout_s": 0.5}  # the master's side of a fast test
FAST_WORKER = ("--heartbeat", "0.1", "--timeout", "0.5")
X = np.arange(6, dtype=np.float32)


def echo_round_trip(t: ZmqTransport, k: int, task: int = 1) -> None:
    t.send(k, Message("echo", {"task": task}, {"x": X}))
    got, reply = answer(t)
    assert (got, reply.header["task"]) == (k, task)
    np.testing.assert_array_equal(reply.arrays["y"], X * 2 + 1)


def hello_header(pid: int) -> dict:
    return {**EchoHandler().hello(), "pid": pid}


class LogWaiter(logging.Handler):
    """Collects a logger's records, so a test can wait for one."""

    def __init__(self, name: str = "transports.session") -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(name)
        self.lines: list[str] = []
        self.cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.lines.append(record.getMessage())
            self.cond.notify_all()

    def wait(self, text: str, timeout: float = TIMEOUT) -> str:
        with self.cond:
            found = self.cond.wait_for(lambda: [line for line in self.lines if text in line], timeout)
        assert found, f"no log line with {text!r} within {timeout:g} s; got {self.lines}"
        return found[0]

    def __enter__(self) -> LogWaiter:
        self.level_before = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def raw_dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


# ---- losing workers ------------------------------------------------------------------------


def lose(t: ZmqTransport, proc, sig: int) -> float:
    """Signal ``proc`` and return how long the master took to declare it lost."""
    proc.send_signal(sig)
    t0 = time.monotonic()
    with pytest.raises(WorkerLost) as info:
        t.recv(TIMEOUT)
    elapsed = time.monotonic() - t0
    assert info.value.worker == 0
    return elapsed


def test_a_stopped_worker_is_lost_within_four_default_heartbeats():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:  # heartbeat 0.4 s, so a patience of 1.6 s
        proc = spawn(t.bound_address)
        try:
            t.start(1, timeout=TIMEOUT)
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(WorkerLost, match=r"worker 0 lost: silent for 1\.\d s \(patience 1\.6 s: 4 heartbeats"):
                t.recv(TIMEOUT)
            elapsed = time.monotonic() - t0
            print(f"\nSIGSTOPped worker declared lost after {elapsed:.2f} s")
            assert elapsed <= 2.0  # at most the patience since its last heartbeat, plus a tick
        finally:
            reap([proc])


def test_a_killed_worker_is_lost_within_a_heartbeat():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
        proc = spawn(t.bound_address)
        try:
            t.start(1, timeout=TIMEOUT)
            elapsed = lose(t, proc, signal.SIGKILL)
            print(f"\nkilled worker declared lost after {elapsed:.2f} s")
            assert elapsed < 1.0 + 1.0  # the next heartbeat finds it disconnected
            with pytest.raises(WorkerLost):
                t.send(0, Message("echo", {"task": 1}, {"x": X}))
        finally:
            reap([proc])


def test_a_worker_whose_pieces_come_further_apart_than_four_heartbeats_is_kept_while_they_flow():
    """A slow link, as a raw worker paces it: gaps between pieces that grow past 4 heartbeats (0.8 s) are
    waited for, as each is within 3 x the longest gap seen before; once the pieces stop, that is the patience."""
    ctx = zmq.Context()
    pace = threading.Event()  # never set: its wait paces the pieces, as a slow link would
    try:
        with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, heartbeat_s=0.2, peer_timeout_s=TIMEOUT) as t:
            worker = raw_dealer(ctx, t.bound_address)
            worker.send_multipart(encode(Message("hello", hello_header(pid=1))))
            t.start(1, timeout=TIMEOUT)
            assert worker.poll(int(TIMEOUT * 1000)) and decode(worker.recv_multipart()).kind == "welcome"
            y = np.arange(300 * 1024 // 4, dtype=np.float32)
            parts = pieces(encode(Message("echoed", {"task": 1}, {"y": y})))
            for gap, piece in zip((0.3, 0.6, 1.0), parts, strict=True):  # the last, 1.0 s, is over 4 heartbeats
                pace.wait(gap)
                worker.send_multipart(piece)
            k, reply = t.recv(TIMEOUT)  # no WorkerLost first
            assert (k, reply.header) == (0, {"task": 1})
            np.testing.assert_array_equal(reply.arrays["y"], y)
            with pytest.raises(WorkerLost, match=r"\(patience 1\.\d s: 3 x the longest gap before a piece, 0\.\d s"):
                t.recv(TIMEOUT)  # silent now: lost after 3 x its longest gap, not after the 20 s ceiling
            worker.close()
    finally:
        ctx.destroy(linger=0)


def test_a_worker_that_comes_back_after_being_lost_joins_under_a_new_index():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, **FAST) as t:
        proc = spawn(t.bound_address, *FAST_WORKER)
        try:
            t.start(1, timeout=TIMEOUT)
            lose(t, proc, signal.SIGSTOP)
            proc.send_signal(signal.SIGCONT)  # it finds its master silent, and says hello again
            (info,) = wait_for(t.joined, what="the worker's return")
            assert (info.index, info.pid, info.device["hellos"]) == (1, proc.pid, 2)
            echo_round_trip(t, 1)
            with pytest.raises(WorkerLost):  # index 0 stays lost
                t.send(0, Message("echo", {"task": 2}, {"x": X}))
        finally:
            t.close()
            reap([proc])


# ---- joining late, and serving several masters ----------------------------------------------


def test_a_late_joiner_is_reported_by_joined_and_served_like_the_others():
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, heartbeat_s=0.2) as t:
        procs = [spawn(t.bound_address)]
        try:
            (first,) = t.start(1, timeout=TIMEOUT)
            assert t.joined() == []
            procs.append(spawn(t.bound_address))
            (late,) = wait_for(t.joined, what="a late worker")
            assert (late.index, late.pid) == (1, procs[1].pid) and t.joined() == []
            echo_round_trip(t, 1)
            echo_round_trip(t, 0, task=2)
            t.close()
            assert [p.wait(timeout=TIMEOUT) for p in procs] == [EXIT_OK, EXIT_OK]
        finally:
            reap(procs)


def test_a_worker_outlives_its_master_and_joins_the_next_one_at_the_same_address(tmp_path):
    address = f"ipc://{tmp_path}/master.sock"
    ctx = zmq.Context()
    first = ctx.socket(zmq.ROUTER)  # a master that welcomes the worker, then dies without a word
    first.setsockopt(zmq.LINGER, 0)
    first.bind(address)
    proc = spawn(address, *FAST_WORKER, "--retry-for", str(TIMEOUT))
    try:
        assert first.poll(int(TIMEOUT * 1000))
        identity, *frames = first.recv_multipart()
        assert decode(frames).kind == "hello"
        first.send_multipart([identity, *encode(Message("welcome", {"index": 0, "heartbeat_s": 0.1}))])
        first.close()
        said = read_stderr_until(proc, "saying hello again")
        assert "lost the master: silent for" in said and "4 heartbeats" in said
        with ZmqTransport(bind=address, protocol=PROTOCOL, **FAST) as t:
            (info,) = t.start(1, timeout=TIMEOUT)
            assert (info.pid, info.device["hellos"]) == (proc.pid, 2)  # hello() again, for the new master
            echo_round_trip(t, info.index)
        assert proc.wait(timeout=TIMEOUT) == EXIT_OK
    finally:
        reap([proc])
        ctx.destroy(linger=0)


def test_a_forever_worker_serves_two_masters_in_a_row(tmp_path):
    address = f"ipc://{tmp_path}/master.sock"
    proc = spawn(address, "--forever")
    try:
        for n in (1, 2):
            with ZmqTransport(bind=address, protocol=PROTOCOL, heartbeat_s=0.2) as t:
                (info,) = t.start(1, timeout=TIMEOUT)
                assert (info.pid, info.device["hellos"]) == (proc.pid, n)
                echo_round_trip(t, info.index, task=n)
            read_stderr_until(proc, "waiting for the next master")  # shutdown: it stays
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == EXIT_INTERRUPTED
    finally:
        reap([proc])


# ---- strangers before admission ------------------------------------------------------------


def test_wrong_versions_and_garbage_before_admission_do_not_stop_start():
    ctx = zmq.Context()
    rng = np.random.default_rng(5)
    try:
        with LogWaiter() as logs, ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
            future_wire, other_protocol, noisy = (raw_dealer(ctx, t.bound_address) for _ in range(3))
            future_wire.send(msgpack.packb({"v": WIRE_VERSION + 1, "kind": "hello", "header": {}, "arrays": []}))
            other_protocol.send_multipart(encode(Message("hello", {**hello_header(1), "protocol": PROTOCOL + 1})))
            for _ in range(300):
                noisy.send(rng.bytes(int(rng.integers(0, 200))))  # garbage
            noisy.send_multipart([b"x"] * 3)  # several frames before a hello
            noisy.send(b"\x00" * (MAX_HEADER_BYTES + 1))  # a frame too big for any hello
            noisy.send_multipart(encode(Message("heartbeat")))  # a heartbeat before any hello
            for sock, what in ((future_wire, "wire"), (other_protocol, "task protocol")):
                assert sock.poll(int(TIMEOUT * 1000))
                reply = decode(sock.recv_multipart())
                assert reply.kind == "error"
                assert f"{what} version mismatch: the worker speaks" in reply.header["message"]
            wait_for(lambda: sum(t.dropped().values()) >= 305, what="every stranger's message counted")
            good = spawn(t.bound_address)
            try:
                (info,) = t.start(1, timeout=TIMEOUT)  # none of it stopped the master waiting
                assert info.pid == good.pid
            finally:
                t.close()
                reap([good])
            counts = t.dropped()
            assert counts["version"] == 2 and counts["oversized"] == 1 and counts["stray"] >= 2
            assert counts["unreadable"] + counts["stray"] >= 302
            dropped_lines = [line for line in logs.lines if line.startswith("dropped")]
            assert len(dropped_lines) == len(counts)  # one line per kind, not one per message
            assert all("summarised every 10 s" in line for line in dropped_lines)
    finally:
        ctx.destroy(linger=0)


def test_a_hello_followed_by_silence_is_forgotten_and_a_heartbeating_one_is_not():
    ctx = zmq.Context()
    worker = None
    try:
        with LogWaiter() as logs, ZmqTransport(bind=LOCAL, protocol=PROTOCOL, **FAST) as t:
            worker = spawn(t.bound_address, *FAST_WORKER)  # says hello, then heartbeats while it waits
            logs.wait(f"(pid {worker.pid}) until start()")
            silent = raw_dealer(ctx, t.bound_address)
            silent.send_multipart(encode(Message("hello", hello_header(pid=1))))  # says hello, then nothing
            logs.wait("forgot a peer at 127.0.0.1 (pid 1): it said hello, then nothing for")
            (info,) = t.start(1, timeout=TIMEOUT)  # the worker kept its place through more than a peer timeout
            assert (info.index, info.pid) == (0, worker.pid)
            assert not silent.poll(0) and t.joined() == []  # the silent one was not welcomed
            t.close()
            assert worker.wait(timeout=TIMEOUT) == EXIT_OK
            silent.close()
    finally:
        reap([worker] if worker else [])
        ctx.destroy(linger=0)


def test_a_workers_message_over_the_total_cap_is_refused():
    ctx = zmq.Context()
    try:
        with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, max_message_bytes=1000) as t:
            d = raw_dealer(ctx, t.bound_address)
            d.send_multipart(encode(Message("hello", hello_header(os.getpid()))))
            t.start(1, timeout=TIMEOUT)
            assert decode(d.recv_multipart()).kind == "welcome"
            arrays = {f"a{i}": np.zeros(100, np.float32) for i in range(3)}  # 3 frames of 400 bytes: 1200 in all
            d.send_multipart(encode(Message("result", {"task": 1}, arrays)))
            with pytest.raises(ProtocolError, match="arrays declare 1200 bytes in all, over the limit of 1000 bytes"):
                t.recv(TIMEOUT)
            d.send_multipart([b"x"] * 18)
            with pytest.raises(ProtocolError, match="malformed message: header frame must be a msgpack map"):
                t.recv(TIMEOUT)
            replies = [decode(d.recv_multipart()) for _ in range(2)]
            assert all("could not read your message" in r.header["message"] for r in replies)
            d.close()
    finally:
        ctx.destroy(linger=0)


def test_the_drop_log_summarises_each_kind_once_per_window():
    now = [0.0]
    logs = LogWaiter("test.droplog")
    with logs:
        drops = DropLog(logs.logger, window_s=10.0, clock=lambda: now[0])
        for i in range(312):
            drops.drop("unreadable", "10.0.0.7", f"garbage {i}")
        drops.drop("version", "10.0.0.8", "wire version mismatch")
        now[0] = 9.9
        drops.flush()
        assert len(logs.lines) == 2  # the first of each kind, in full
        now[0] = 10.0
        drops.flush()  # the window is over: one summary for what came after the first
        drops.flush()
        now[0] = 25.0
        drops.flush()  # a quiet window closes without a line...
        drops.drop("unreadable", "10.0.0.9", "more garbage")  # ...and the next is told in full again
    assert logs.lines == [
        "dropped one unreadable message from 10.0.0.7: garbage 0 (more are summarised every 10 s)",
        "dropped one hello of another version from 10.0.0.8: wire version mismatch (more are summarised every 10 s)",
        "dropped 311 unreadable messages from 1 peer in the last 10 s; the latest: garbage 311",
        "dropped one unreadable message from 10.0.0.9: more garbage (more are summarised every 10 s)",
    ]
    assert drops.counts() == {"unreadable": 313, "version": 1}
