"""Tasks out to the workers, results back: task ids, deadlines, early replies, clear errors.

Each distributed op (the forward or the backward of one sharded layer) opens an
:class:`Op`. It numbers every task it sends; :meth:`Op.gather` waits for the results of
some of them, each within the timeout, and keeps any result of the op's other tasks that
comes first for the gather that wants it. A result of a task no open op is waiting for
-- one an op gave up on -- is stale and dropped. A worker's ``error`` becomes a
RuntimeError naming the worker and the op. A worker the op cannot count on -- gone
(the transport's WorkerLost), silent past the timeout, or answering finite inputs with
non-finite numbers -- ends the op with :class:`Lost`, naming each and why, so that the
cluster can share its kernels among the others and run the op again. On the way the op
counts what it cost (:meth:`Op.stats`).

The one optimisation here is :meth:`Op.relay`: a second round of tasks that each go out
as soon as what they need has come back, while the rest of the first round is still
computing. It is the only place where transfers overlap; the splits that use it
(``by_channels.py``) read as two plain rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import numpy as np

from backends.base import Array, Backend
from tinyconv.shard.accounting import OpStats
from tinyconv.shard.protocol import check_result
from transports.base import Message, Transport, WorkerInfo, WorkerLost

log = logging.getLogger(__name__)


class Lost(Exception):
    """Workers an op could not count on: worker index -> why."""

    def __init__(self, workers: dict[int, str]) -> None:
        super().__init__("; ".join(f"worker {k}: {why}" for k, why in workers.items()))
        self.workers = workers


class Rpc:
    """The master's side of the task protocol, over one transport."""

    def __init__(self, transport: Transport, workers: list[WorkerInfo], timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"recv_timeout must be > 0 seconds, got {timeout!r}")
        self.transport = transport
        self.workers = {w.index: w for w in workers}
        self.timeout = float(timeout)
        self._next_task = 0

    def op(
        self, what: str, backend: Backend, fields: dict[str, int] | None = None, timeout: float | None = None
    ) -> Op:
        """A new op, ``what`` naming it in errors ("forward of conv2"), the master computing its own
        share on ``backend``; every task it sends carries ``fields`` (a layer's step and index), and
        every worker has ``timeout`` seconds (default: the Rpc's) to answer each gather."""
        return Op(self, what, backend, fields or {}, timeout or self.timeout)

    def describe(self, k: int | None) -> str:
        if k is None:
            return "the master"
        info = self.workers[k]
        where = info.hostname or info.address or "?"
        return f"worker {k} ({info.backend} on {info.device.get('device', '?')} at {where})"

    def new_task_id(self) -> int:
        self._next_task += 1
        return self._next_task


class Op:
    """The tasks of one distributed op, and what it cost: bytes, each worker's compute, the master's."""

    def __init__(self, rpc: Rpc, what: str, backend: Backend, fields: dict[str, int], timeout: float) -> None:
        self.rpc, self.what, self.backend, self.fields, self.timeout = rpc, what, backend, fields, timeout
        self.t0 = time.perf_counter()
        self._pending: dict[int, tuple[int, Message]] = {}  # task -> (worker, the task), sent, not yet gathered
        self._early: dict[int, Message] = {}  # task -> its result, come before its gather
        self.sent: dict[int, int] = {}  # worker -> array bytes sent to it
        self.recv: dict[int, int] = {}
        self.compute: dict[int, float] = {}  # worker -> seconds it reported
        self.master_s = 0.0

    def send(self, worker: int, msg: Message) -> int:
        """Send ``msg`` to ``worker`` as a new task, with the op's fields; returns its task id."""
        task = self.rpc.new_task_id()
        msg.header.update(self.fields, task=task)
        try:
            self.rpc.transport.send(worker, msg)
        except WorkerLost as e:
            raise Lost({worker: e.reason}) from None
        self._pending[task] = (worker, msg)
        self.sent[worker] = self.sent.get(worker, 0) + msg.nbytes()
        return task

    @contextmanager
    def local(self) -> Iterator[None]:
        """Time the master's own share of the op (computed while the workers compute theirs)."""
        t = time.perf_counter()
        yield
        self.backend.synchronize()
        self.master_s += time.perf_counter() - t

    def host(self, a: Array) -> np.ndarray:
        """A master's backend array as a C-contiguous float32 host array, to send (a view when it is one)."""
        return np.ascontiguousarray(self.backend.to_numpy(a), dtype=np.float32)

    def gather(self, tasks: Iterable[int], each: Callable[[int, Message], None] | None = None) -> dict[int, Message]:
        """The result of every task in ``tasks``, by worker; ``each(worker, result)`` as each arrives."""
        waiting = set(tasks)
        results: dict[int, Message] = {}
        deadline = time.monotonic() + self.timeout
        while waiting:
            task = next((t for t in waiting if t in self._early), None)
            if task is not None:
                reply = self._early.pop(task)
            else:
                task, reply = self._receive(deadline, waiting)
                if task not in waiting:
                    continue
            worker, _ = self._pending.pop(task)
            waiting.discard(task)
            results[worker] = reply
            if each is not None:
                each(worker, reply)
        return results

    def relay(
        self,
        first: dict[int, int],
        ready: Callable[[int], bool],
        then: Callable[[int], Message],
        each: Callable[[int, Message], None],
    ) -> dict[int, int]:
        """Gather the first round (worker -> task), ``each(worker, result)`` as results come, and send
        worker k its second-round task ``then(k)`` as soon as ``ready(k)`` -- which can be before the
        rest of the first round is in, or before its own result is (the optimisation: the second
        round's transfers overlap the first round's compute). Returns the second round, worker -> task.
        """
        second: dict[int, int] = {}

        def send_ready() -> None:
            for k in first:
                if k not in second and ready(k):
                    second[k] = self.send(k, then(k))

        def arrived(k: int, reply: Message) -> None:
            each(k, reply)
            send_ready()

        send_ready()
        self.gather(first.values(), arrived)
        return second

    def array(self, worker: int, reply: Message, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Array ``name`` of a worker's result, which must have ``shape``."""
        a = reply.arrays.get(name)
        if a is None or tuple(a.shape) != shape:
            got = "nothing" if a is None else f"shape {tuple(a.shape)}"
            raise RuntimeError(
                f"{self.rpc.describe(worker)} returned {got} for {name!r} in the {self.what}, expected shape "
                f"{shape}; is it running the same tinyconv version?"
            )
        return a

    def stats(self, seats: list[tuple[str, int | None]]) -> OpStats:
        """What the op cost so far, in participant order (seats: (name, worker index or None))."""
        return OpStats(
            names=[name for name, _ in seats],
            wall_s=time.perf_counter() - self.t0,
            compute_s=[self.master_s if k is None else self.compute.get(k, 0.0) for _, k in seats],
            sent=[0 if k is None else self.sent.get(k, 0) for _, k in seats],
            recv=[0 if k is None else self.recv.get(k, 0) for _, k in seats],
        )

    def _receive(self, deadline: float, waiting: set[int]) -> tuple[int, Message]:
        """The next result for one of this op's tasks; one of ``waiting`` or kept as early."""
        while True:
            try:
                k, reply = self.rpc.transport.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                why = f"no result for the {self.what} within {self.timeout:g} s"
                raise Lost({self._pending[t][0]: why for t in waiting}) from None
            except WorkerLost as e:
                raise Lost({e.worker: e.reason}) from None
            task = reply.header.get("task")
            ours = task in self._pending and self._pending[task][0] == k
            if reply.kind == "error" and (task is None or ours):
                raise RuntimeError(f"{self.rpc.describe(k)} failed the {self.what}: {reply.header['message']}")
            if not ours:  # a late answer to an op given up on
                log.debug("ignoring a stale %s from worker %d (task %r)", reply.kind, k, task)
                continue
            if reply.kind != "result":
                raise RuntimeError(f"{self.rpc.describe(k)} answered the {self.what} with a {reply.kind!r}")
            sent = self._pending[task][1]
            check_result(reply, sent.kind)
            _check_finite(k, reply, sent, self.what)
            self.recv[k] = self.recv.get(k, 0) + reply.nbytes()
            self.compute[k] = self.compute.get(k, 0.0) + float(reply.header["compute_s"])
            if task not in waiting:
                self._early[task] = reply
            return task, reply


def _check_finite(k: int, reply: Message, sent: Message, what: str) -> None:
    """A worker that answers finite inputs with a NaN or an infinity is not to be trusted: Lost. (From
    non-finite inputs -- a diverged model -- the master's own numbers are no better: let them through.)"""
    bad = [name for name, a in reply.arrays.items() if not np.isfinite(a).all()]
    if bad and all(np.isfinite(a).all() for a in sent.arrays.values()):
        raise Lost({k: f"returned non-finite values in {', '.join(bad)} for the {what}, from finite inputs"})
