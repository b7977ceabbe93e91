"""A seeded chaos run: 100 steps of SGD on a paper-shaped network while in-process workers die, hang,
fail, lie and join on a fixed schedule. The run finishes every step by itself, each loss is named,
and its last loss is the clean run's to 1e-3.

Faults are keyed on the step a task carries (``header["step"]``, the steps finished), never on time, so
the schedule and its events are the same every run; only the deadlines are seconds (``RECV_TIMEOUT``).

Not here: the faults of processes. tests/test_chaos_processes.py runs the main job with worker processes
SIGKILLed (a fresh one joining late) and SIGSTOPped then continued, its master's training process SIGKILLed
under --max-restarts, the master stopped by SIGTERM and run again with --resume, and, as root, one worker
behind a shaped link (benchmarks/throttled_link.py); tests/test_membership.py and test_elastic.py time a
killed or stopped worker's loss, test_example.py each signal of the master alone.
A worker lost here cannot come back: an in-process worker has no way to join again under a new index.
A joiner times itself beside the steps (``joiners.py``) and is seated at the step boundary after its
answer; so that the schedule is the same every run, the test waits for each joiner's answer before the
next step (the master never does), and moves the joiners' clock past the deadline of the one that
never answers after step SKIP_AT, where it is left out.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from backends.numpy_backend import NumpyBackend
from tinyconv.distributed import joiners
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.worker.handler import Worker
from tinyconv.model import paper_net
from tinyconv.optim import SGD
from transports.base import Message, WorkerInfo
from transports.inproc import InprocTransport

STEPS, BATCH, IMAGE = 100, 8, 8
# products small enough for OpenBLAS to run on one thread: its spinning threads would starve the workers' on 2 cores
ARCH = "6:12"
RECV_TIMEOUT = 2.0  # the most a worker has for an op or its calibration: a hung one costs at most this
SKIP_AT = 50  # after this step the joiners' clock jumps past RECV_TIMEOUT
TIMEOUT = 20.0  # every other wait of the test
# a worker that dies ends its thread on purpose; pytest would report the death as a warning
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class Faulty(Worker):
    """A worker that misbehaves from the first task of step ``at`` on, as ``fault`` says (None: never).

    "dies": its thread ends in that step's first backward, between a forward and its backward;
    "dies late": its thread ends in that step's last backward (conv1's, which needs no dx), after the layer
    above has finished the step with it;
    "stops": it hangs in that step's first task until ``resume`` is set, then answers it (too late) and goes on;
    "error": it answers with an error, as a device out of memory; "shape": a forward one kernel short;
    "nan": NaNs; "x-50": every number times -50 (finite, well formed, and wrong: the spot check's);
    "no calibration": it never answers its calibration.
    """

    def __init__(self, backend, fault: str | None = None, at: int = 0) -> None:
        super().__init__(backend)
        self.fault, self.at = fault, at
        self.resume, self.answered = threading.Event(), threading.Event()

    def handle(self, msg: Message) -> Message | None:
        if self.fault == "no calibration" and msg.kind == "calibrate":
            return None
        if msg.header.get("step", -1) < self.at or self.fault in (None, "no calibration"):
            return super().handle(msg)
        if self.fault == "dies" and msg.kind == "block_backward":
            raise SystemExit("switched off")
        if self.fault == "dies late" and msg.kind == "block_backward" and not msg.header["need_dx"]:
            raise SystemExit("switched off")
        if self.fault == "stops" and not self.answered.is_set():
            self.resume.wait(TIMEOUT)  # as SIGSTOP and SIGCONT: the task waits, then runs
            self.answered.set()
        if self.fault == "error":
            raise MemoryError("out of device memory")
        reply = super().handle(msg)
        if self.fault == "shape" and msg.kind == "block_forward":
            reply.arrays["y"] = reply.arrays["y"][:, 1:]
        elif self.fault == "nan":
            for a in reply.arrays.values():
                a.fill(np.nan)
        elif self.fault == "x-50":
            reply.arrays = {k: a * np.float32(-50) for k, a in reply.arrays.items()}
        return reply


class Arrivals(InprocTransport):
    """In-process workers of which some join late: ``joins_after[i]``, the step after which worker i joins
    (0: at the start). The cluster asks joined() once at the end of each step."""

    def __init__(self, workers: list[Faulty], joins_after: list[int]) -> None:
        super().__init__(lambda i: workers[i], protocol=VERSION)
        self.joins_after, self.steps, self.late = joins_after, 0, []

    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        infos = super().start(n_workers, timeout)
        self.late = [w for w in infos if self.joins_after[w.index]]
        return [w for w in infos if not self.joins_after[w.index]]

    def joined(self) -> list[WorkerInfo]:
        self.steps += 1
        return [w for w in self.late if self.joins_after[w.index] == self.steps]


# worker i: (what goes wrong, from which step, the step after which it joins); the joiners replace the lost, so
# that one to four workers serve the master at any time
SCHEDULE = [
    (None, None, 0),  # worker0: healthy throughout
    ("dies", 10, 0),  # worker1
    ("stops", 20, 0),  # worker2
    ("error", 30, 5),  # worker3
    ("shape", 40, 15),  # worker4
    ("nan", 50, 25),  # worker5
    ("no calibration", 0, 45),  # worker6
    (None, None, 55),  # worker7
    ("x-50", 0, 65),  # worker8: wrong from its first step, caught in it (the check samples a new worker at once)
]
LOST = {  # worker -> the step it is lost in, and what its reason says
    1: (10, "its thread died: SystemExit: switched off"),
    2: (20, "no result for the forward of conv1 within"),
    3: (30, "failed the forward of conv1: block_forward failed: MemoryError: out of device memory"),
    4: (40, "for 'y' in the forward of conv1, expected shape (8, "),  # one kernel short of its share
    5: (50, "returned non-finite values in y for the forward of conv1, from finite inputs"),
    8: (66, "wrong result: its smallest output, which ReLU, LRN and max pool leave at 0 or above, is "),
}


def answered(cluster: Cluster, transport: Arrivals, workers: list[Faulty]) -> None:
    """Wait (bounded) until every joiner timing itself, but the one that never will, has answered."""
    waiting = {
        k for k, j in cluster.joiners.waiting.items() if j.reply is None and workers[k].fault != "no calibration"
    }
    while waiting:
        k, reply = transport.recv(timeout=TIMEOUT)  # anything else that comes is a stale answer: dropped
        if cluster.rpc.aside(k, reply):
            waiting.discard(k)


class Skewed:
    """The joiners' clock: the real one, plus what the test adds."""

    def __init__(self) -> None:
        self.skew = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skew


def train(schedule, x, y, clock: Skewed | None = None) -> tuple[list[float], Cluster, list[dict], list[Faulty]]:
    """100 steps of the same network on the same batches, with ``schedule``'s workers; the losses, the
    cluster, its events and the workers."""
    net = paper_net(ARCH, NumpyBackend(), seed=0, image_size=IMAGE)
    opt, losses = SGD(net, lr=0.01, momentum=0.9), []
    workers = [Faulty(NumpyBackend(), fault, at or 0) for fault, at, _ in schedule]
    transport = Arrivals(workers, [joins for *_, joins in schedule])
    with transport:
        start = transport.start(len(schedule), timeout=TIMEOUT)
        cluster = Cluster(transport, start, NumpyBackend(), split="kernels", recv_timeout=RECV_TIMEOUT,
                          rebalance=False, calibration_repeats=1)  # fmt: skip
        cluster.calibrate(net, batch_size=BATCH, image_size=IMAGE)
        for step in range(STEPS):
            losses.append(cluster.train_batch(net, x[step % len(x)], y[step % len(y)])[0])  # as the trainer does
            opt.step()
            for w in workers:
                if w.fault == "stops" and w.at == step:
                    w.resume.set()  # lost in this step; now it answers its task, late
            answered(cluster, transport, workers)
            if clock is not None and step == SKIP_AT:
                clock.skew += 2 * RECV_TIMEOUT
        cluster.close()
    return losses, cluster, cluster.pop_events(), workers


def test_a_seeded_chaos_run_completes_every_step_and_ends_at_the_clean_runs_loss(rng, caplog, monkeypatch):
    x = rng.standard_normal((4, BATCH, 3, IMAGE, IMAGE), dtype=np.float32)
    y = rng.integers(0, 10, (4, BATCH))
    clean, _, clean_events, _ = train([(None, None, 0)] * 3, x, y)
    with caplog.at_level(logging.DEBUG, logger="tinyconv.distributed"):
        clock = Skewed()
        monkeypatch.setattr(joiners, "time", clock)
        losses, cluster, events, workers = train(SCHEDULE, x, y, clock)

    assert clean_events == [] and len(losses) == STEPS and np.all(np.isfinite(losses))
    assert losses[-1] == pytest.approx(clean[-1], rel=1e-3) and losses[-1] < losses[0]
    joined = [(e["worker"], e["step"]) for e in events if e["event"] == "worker_joined"]
    assert joined == [("worker3", 6), ("worker4", 16), ("worker5", 26), ("worker7", 56), ("worker8", 66)]
    lost = [(int(e["worker"][6:]), e["step"], e["reason"]) for e in events if e["event"] == "worker_lost"]
    (never,) = [item for item in lost if item[0] == 6]  # at its deadline: the boundary after the next step
    assert never == (6, SKIP_AT + 2, f"joined, then did not answer its calibration within {RECV_TIMEOUT:g} s")
    lost.remove(never)
    assert [(k, step) for k, step, _ in lost] == [(k, step) for k, (step, _) in LOST.items()]
    for (k, _, reason), (_, says) in zip(lost, LOST.values(), strict=True):
        assert says in reason, (k, reason)
    assert set(cluster.lost) == {*LOST, 6} and cluster.participants == ["master", "worker0", "worker7"]
    # the stopped worker answered its task after all: too late, dropped, and it stayed out
    assert workers[2].answered.is_set() and "ignoring a stale result from worker 2" in caplog.text


def test_a_worker_lost_in_the_steps_last_backward_ends_neither_the_step_nor_the_run(rng):
    """conv2 finishes its step with worker1, which then dies in conv1's backward: the step's accounting holds a
    layer of three participants beside a placement of two, and the step and the run go on without it."""
    x = rng.standard_normal((4, BATCH, 3, IMAGE, IMAGE), dtype=np.float32)
    y = rng.integers(0, 10, (4, BATCH))
    clean, *_ = train([(None, None, 0)] * 2, x, y)
    losses, cluster, events, _ = train([(None, None, 0), ("dies late", 3, 0)], x, y)

    assert len(losses) == STEPS and losses[-1] == pytest.approx(clean[-1], rel=1e-3)
    assert [(e["event"], e["worker"], e["step"]) for e in events] == [("worker_lost", "worker1", 3)]
    assert cluster.participants == ["master", "worker0"]
