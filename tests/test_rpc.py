"""Scatter/gather: task ids, early and stale replies, errors and timeouts that name who, and the relay
that sends a second round as soon as it can -- against a scripted transport, no workers."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from backends.numpy_backend import NumpyBackend
from tinyconv.distributed.accounting import OpStats
from tinyconv.distributed.link_speed import LinkSpeed
from tinyconv.distributed.rpc import Lost, Rpc
from tinyconv.distributed.shard.by_channels import relay
from transports.base import Message, Transport, WorkerInfo, WorkerLost

BE = NumpyBackend()
WORKERS = [WorkerInfo(0, "numpy", {"device": "cpu0"}, hostname="a"), WorkerInfo(1, "numpy", {"device": "cpu1"})]


class Scripted(Transport):
    """A transport whose workers answer by a script: ``answer(worker, msg)`` -> replies to queue.

    ``held`` keeps a worker's replies back until ``release(worker)``, to play out an order."""

    name = "scripted"

    def __init__(self, answer) -> None:
        self.answer, self.sent, self.inbox, self.held = answer, [], deque(), {}

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        return WORKERS[:n_workers]

    def send(self, worker: int, msg: Message) -> None:
        self.sent.append((worker, msg.kind, msg.header["task"]))
        for reply in self.answer(worker, msg):
            (self.held[worker] if worker in self.held else self.inbox).append((worker, reply))

    def recv(self, timeout: float) -> tuple[int, Message]:
        if not self.inbox:
            raise TimeoutError("nothing")
        return self.inbox.popleft()

    def close(self) -> None:
        pass

    def release(self, worker: int) -> None:
        self.inbox.extend(self.held.pop(worker))


def result(msg: Message, **arrays) -> Message:
    return Message("result", {"task": msg.header["task"], "compute_s": 0.5}, arrays)


def echo(worker: int, msg: Message) -> list[Message]:
    """A result carrying y = [worker, worker] for a forward of a block or tail, else nothing."""
    y = {"y": np.full((2,), worker, np.float32)} if msg.kind in ("block_forward", "tail_forward") else {}
    return [result(msg, **y)]


def test_gather_returns_each_workers_result_and_counts_the_bytes_and_compute():
    rpc = Rpc(Scripted(echo), WORKERS, timeout=1.0)
    op = rpc.op("forward of conv1", BE)
    tasks = [op.send(k, Message("block_forward", {}, {"x": np.zeros(3, np.float32)})) for k in (0, 1)]
    assert tasks == [1, 2]  # ids, in the order sent
    replies = op.gather(tasks)
    assert [float(replies[k].arrays["y"][0]) for k in (0, 1)] == [0.0, 1.0]
    stats = OpStats.from_op(op, [("master", None), ("worker0", 0), ("worker1", 1)])
    assert stats.sent == [0, 12, 12] and stats.recv == [0, 8, 8] and stats.compute_s == [0.0, 0.5, 0.5]


def test_a_result_that_comes_before_its_gather_is_kept_for_it():
    transport = Scripted(echo)
    transport.held[0] = deque()  # worker 0's first answer comes after worker 1's second
    op = Rpc(transport, WORKERS, timeout=1.0).op("backward of conv2", BE)
    first = op.send(0, Message("tail_backward", {}))
    second = op.send(1, Message("partial_backward", {}))
    transport.release(0)
    transport.inbox.rotate(1)  # worker 0's answer last
    assert set(op.gather([second])) == {1}
    assert set(op.gather([first])) == {0}  # from the transport, not lost while the other was gathered


def test_a_late_result_of_an_abandoned_op_is_dropped():
    transport = Scripted(echo)
    rpc = Rpc(transport, WORKERS, timeout=1.0)
    rpc.op("forward of conv1", BE).send(0, Message("block_forward", {}))  # given up on: never gathered
    op = rpc.op("forward of conv1", BE)
    task = op.send(0, Message("block_forward", {}))
    assert op.gather([task])[0].header["task"] == task  # the stale one went by


@pytest.mark.parametrize(
    "answer, text",
    [
        (lambda k, m: [Message("error", {"message": "out of memory", "task": m.header["task"]})],
         r"worker 1: failed the forward of conv1: out of memory"),
        (lambda k, m: [Message("error", {"message": "unreadable"})], "worker 1: failed the forward of conv1"),
        (lambda k, m: [Message("hello", {"task": m.header["task"]})], "worker 1: answered .* with a 'hello'"),
        (lambda k, m: [Message("result", {"task": m.header["task"]})], "worker 1: sent a malformed result.*compute_s"),
        (lambda k, m: [result(m, z=np.zeros(1, np.float32))], "malformed result.*a result of block_forward takes"),
        (lambda k, m: [], r"worker 1: no result for the forward of conv1 within 0.01 s"),
    ],
)  # fmt: skip
def test_whatever_goes_wrong_with_a_worker_loses_it_naming_the_op(answer, text):
    # an error reply (out of memory, a driver's), a wrong kind, a malformed result, silence: the op ends with
    # Lost for that worker, which the runtime answers by sharing its work among the others
    op = Rpc(Scripted(answer), WORKERS, timeout=0.01).op("forward of conv1", BE)
    with pytest.raises(Lost, match=text):
        op.gather([op.send(1, Message("block_forward", {}))])


def test_a_reply_array_of_another_shape_loses_the_worker_with_a_hint():
    op = Rpc(Scripted(echo), WORKERS, timeout=1.0).op("forward of conv2", BE)
    reply = op.gather([op.send(0, Message("block_forward", {}))])[0]
    assert op.array(0, reply, "y", (2,)).shape == (2,)
    with pytest.raises(Lost, match=r"worker 0: returned shape \(2,\) for 'y' in the forward of conv2, expected shape"):
        op.array(0, reply, "y", (3,))


def test_relay_sends_each_second_round_task_as_soon_as_it_is_ready():
    # worker 0's second task needs worker 1's first result, worker 1's needs worker 0's:
    # worker 0 answers late, so worker 0's second task goes out before its own first result is in
    transport = Scripted(echo)
    transport.held[0] = deque()
    op = Rpc(transport, WORKERS, timeout=1.0).op("forward of conv2", BE)
    first = {k: op.send(k, Message("partial_forward", {})) for k in (0, 1)}
    have = set()

    def arrived(k: int, reply: Message) -> None:
        have.add(k)
        if k == 1:
            transport.release(0)  # worker 0 answers only now

    second = relay(op, first, lambda k: (1 - k) in have, lambda k: [Message("tail_forward", {})], arrived)
    assert transport.sent == [
        (0, "partial_forward", 1),
        (1, "partial_forward", 2),
        (0, "tail_forward", 3),  # as soon as worker 1's partial is in
        (1, "tail_forward", 4),
    ]
    assert set(op.gather(t for tasks in second.values() for t in tasks)) == {0, 1}


def test_a_worker_the_transport_lost_ends_the_op_with_lost():
    class Gone(Scripted):
        def recv(self, timeout: float):
            raise WorkerLost(0, "disconnected")

    op = Rpc(Gone(echo), WORKERS, timeout=1.0).op("forward of conv1", BE)
    with pytest.raises(Lost) as info:
        op.gather([op.send(0, Message("block_forward", {}))])
    assert info.value.workers == {0: "disconnected"}


def test_a_late_notice_that_a_worker_without_a_task_in_the_op_was_lost_leaves_the_op_alone():
    # worker 1 was dropped earlier (a deadline, a wrong result); its link gives it up only now
    class Late(Scripted):
        def recv(self, timeout: float):
            if not self.noticed:
                self.noticed = True
                raise WorkerLost(1, "silent for 1.6 s")
            return super().recv(timeout)

    transport = Late(echo)
    transport.noticed = False
    op = Rpc(transport, WORKERS, timeout=1.0).op("backward of conv1", BE)
    replies = op.gather([op.send(0, Message("block_forward", {}))])
    assert transport.noticed and list(replies) == [0]


def test_an_uncalibrated_worker_is_paced_by_a_participant_on_its_own_backend_only():
    # an OpenCL worker's first task also builds its kernels, which a numpy master's pace knows nothing of
    workers = [WORKERS[0], WorkerInfo(1, "opencl", {"device": "gpu0"})]
    op = Rpc(Scripted(echo), workers, timeout=60.0).op("forward of conv1", BE, units={None: 2, 0: 4, 1: 4})
    op.master_s = 0.5
    assert op.expected(0) == pytest.approx(1.0) and op.expected(1) is None
    op.compute[1] = 3.0  # the first OpenCL worker that answered paces the others on OpenCL
    assert op.expected(1) == pytest.approx(3.0)


def nan_echo(worker: int, msg: Message) -> list[Message]:
    return [result(msg, y=np.array([np.nan, 1.0], np.float32))]


def test_non_finite_results_from_finite_inputs_end_the_op_with_lost():
    op = Rpc(Scripted(nan_echo), WORKERS, timeout=1.0).op("forward of conv2", BE)
    task = op.send(1, Message("block_forward", {}, {"x": np.ones(3, np.float32)}))
    with pytest.raises(Lost, match="worker 1: returned non-finite values in y for the forward of conv2"):
        op.gather([task])


def test_non_finite_results_from_non_finite_inputs_go_through():
    # a diverged model: the master's own numbers are no better, the trainer says so
    op = Rpc(Scripted(nan_echo), WORKERS, timeout=1.0).op("forward of conv2", BE)
    task = op.send(1, Message("block_forward", {}, {"x": np.array([np.inf], np.float32)}))
    assert np.isnan(op.gather([task])[1].arrays["y"][0])


class Arriving(Scripted):
    """Replies arrive while the master waits for them: a poll (timeout 0) finds none."""

    def recv(self, timeout: float) -> tuple[int, Message]:
        if timeout == 0:
            raise TimeoutError("nothing yet")
        return super().recv(timeout)


@pytest.mark.parametrize("transport, exact", [(Scripted, False), (Arriving, True)], ids=["come", "waited for"])
def test_a_result_measures_its_workers_link_only_if_the_master_waited_for_it(transport, exact):
    clock = [0.0]
    rpc = Rpc(transport(echo), WORKERS, timeout=1.0, clock=lambda: clock[0])
    op = rpc.op("forward of conv1", BE)
    task = op.send(0, Message("block_forward", {}, {"x": np.zeros(3, np.float32)}))  # 12 bytes, 8 back
    clock[0] = 2.5  # 0.5 s of it the worker's compute: 2 s for 20 bytes
    op.gather([task])
    assert rpc.link(0).seconds_per_byte() == (pytest.approx(0.1) if exact else None)  # else only an upper bound
    assert rpc.link(1).seconds_per_byte() is None  # nothing measured


def test_a_workers_first_step_does_not_measure_its_link():
    """Its first step's tasks pay for first use (allocations, faults): where the master finishes last no later
    task is waited for, and such a sample would stand alone. A calibration's task (no step) is filed."""
    clock = [0.0]
    rpc = Rpc(Arriving(echo), WORKERS, timeout=1.0, clock=lambda: clock[0])
    for step, took in [(3, 50.0), (3, 50.0), (4, 2.5)]:  # 20 bytes each, 0.5 s of compute
        op = rpc.op("forward of conv1", BE, {"step": step})
        task = op.send(0, Message("block_forward", {}, {"x": np.zeros(3, np.float32)}))
        clock[0] += took
        op.gather([task])
        clock[0] = 0.0
        assert rpc.link(0).seconds_per_byte() == (pytest.approx(0.1) if step == 4 else None)
    op = rpc.op("calibration", BE)
    task = op.send(1, Message("block_forward", {}, {"x": np.zeros(3, np.float32)}))
    clock[0] = 2.5
    op.gather([task])
    assert rpc.link(1).seconds_per_byte() == pytest.approx(0.1)


def test_the_op_counts_only_the_time_the_master_sat_blocked_on_a_result():
    clock = [0.0]

    class Slow(Scripted):
        """The first result is there at once (a poll finds it); the second takes 2 s of waiting."""

        def recv(self, timeout: float) -> tuple[int, Message]:
            if timeout == 0 and len(self.inbox) < 2:
                raise TimeoutError("nothing yet")
            if timeout > 0:
                clock[0] += 2.0
            return super().recv(timeout)

    rpc = Rpc(Slow(echo), WORKERS, timeout=10.0, clock=lambda: clock[0])
    op = rpc.op("forward of conv1", BE)
    tasks = [op.send(k, Message("block_forward", {}, {"x": np.zeros(3, np.float32)})) for k in (0, 1)]
    op.gather(tasks)
    assert OpStats.from_op(op, [("master", None), ("worker0", 0), ("worker1", 1)]).master_waited_s == pytest.approx(2.0)


def test_a_link_is_the_median_of_its_samples_and_ignores_tasks_without_bytes():
    link = LinkSpeed()
    for nbytes, seconds in [(100, 1.0), (100, 1.0), (100, 50.0), (0, 9.0), (100, -1.0)]:
        link.add(nbytes, seconds)  # one stall; a task without arrays; compute reported long
    assert list(link.samples) == [0.01, 0.01, 0.5, 0.0] and link.seconds_per_byte() == pytest.approx(0.01)


class Halving:
    """A codec that sends x as float16 and widens y back; each direction counts one fallback."""

    def __init__(self) -> None:
        self.decoded: list[tuple[int, str]] = []

    def encode(self, msg: Message) -> tuple[Message, int]:
        return Message(msg.kind, msg.header | {"half": True}, {"x": msg.arrays["x"].astype(np.float16)}), 1

    def decode(self, reply: Message, task: Message) -> tuple[Message, int]:
        self.decoded.append((reply.header["task"], task.arrays["x"].dtype.name))
        return Message(reply.kind, reply.header, {"y": reply.arrays["y"].astype(np.float32)}), 1


def test_an_ops_codec_encodes_each_task_as_it_goes_and_decodes_each_result_and_the_default_is_the_identity():
    def half_echo(worker: int, msg: Message) -> list[Message]:
        assert msg.header["half"] and msg.arrays["x"].dtype == np.float16  # what went is the encoded task
        return [result(msg, y=np.full((2,), worker, np.float16))]

    codec = Halving()
    op = Rpc(Scripted(half_echo), WORKERS, timeout=1.0).op("forward of conv1", BE, codec=codec)
    replies = op.gather([op.send(k, Message("block_forward", {}, {"x": np.zeros(3, np.float32)})) for k in (0, 1)])
    assert [replies[k].arrays["y"].dtype for k in (0, 1)] == [np.float32, np.float32]
    assert sorted(codec.decoded) == [(1, "float16"), (2, "float16")]  # each result with its task as it went
    stats = OpStats.from_op(op, [("worker0", 0), ("worker1", 1)])
    assert stats.sent == [6, 6] and stats.recv == [4, 4] and op.fallbacks == stats.fallbacks == 4  # what moved
    sent: list[Message] = []
    plain = Rpc(Scripted(lambda k, m: sent.append(m) or echo(k, m)), WORKERS, timeout=1.0).op("forward of conv1", BE)
    task = Message("block_forward", {}, {"x": np.zeros(3, np.float32)})
    plain.gather([plain.send(0, task)])
    assert len(sent) == 1 and sent[0] is task and plain.fallbacks == 0  # the identity: the very message
