"""Tasks out to the workers, results back: task ids, deadlines, early replies, clear errors.

Each distributed op (the forward or the backward of one sharded layer) opens an :class:`Op`. It
numbers every task it sends; :meth:`Op.gather` waits for the results of some of them, and keeps a
result that comes before its gather asks for it; a result no open op waits for is stale and dropped.
Deadlines are for compute, liveness for transfers (docs/how-it-works.md, "When workers come and go").
A worker the op cannot count on -- gone, past its deadline, answering with an error, a malformed
result, non-finite numbers from finite inputs, or numbers the spot check finds wrong (``spot_check.py``)
-- ends the op with :class:`Lost`, so that the runtime can share its work among the others and run the
op again. On the way the op counts what it cost (``OpStats.from_op``) and each link's seconds per byte
(``link_speed.py``); its codec (``wire_codec.py``, by default none) encodes each task and decodes each
result, so the splits only ever see float32.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np

from backends.base import Array, Backend
from tinyconv.distributed.accounting import Times
from tinyconv.distributed.link_speed import LinkSpeed
from tinyconv.distributed.protocol import check_result
from tinyconv.distributed.wire_codec import Narrowing
from transports.base import Message, Transport, WorkerInfo, WorkerLost

log = logging.getLogger(__name__)


class Lost(Exception):
    """Workers an op could not count on: worker index -> why. ``wrong``: their answers were wrong, not missing
    (a wrong shape or dtype, NaN, a failed spot check): the runtime refuses them for a while."""

    def __init__(self, workers: dict[int, str], wrong: bool = False) -> None:
        super().__init__("; ".join(f"worker {k}: {why}" for k, why in workers.items()))
        self.workers, self.wrong = workers, wrong


class Rpc:
    """The master's side of the task protocol, over one transport. ``clock`` (monotonic seconds) times the
    deadlines and the links' samples: a test's fake clock can drive both, with a transport that delivers by it."""

    def __init__(
        self,
        transport: Transport,
        workers: list[WorkerInfo],
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"recv_timeout must be > 0 seconds, got {timeout!r}")
        self.transport = transport
        self.workers = {w.index: w for w in workers}
        self.timeout = float(timeout)
        self.clock = clock
        self.links: dict[int, LinkSpeed] = {}  # worker -> what its tasks measured of its link
        self.aside: Callable[[int, Message], bool] | None = None  # takes a reply no op waits for: joiners.py
        # (worker, task, its result, the master's backend) -> None, or Lost for a wrong result: spot_check.py
        self.check: Callable[[int, Message, Message, Backend], None] | None = None
        # (worker, task) -> arrays the spot check asks to go with the task (its probe: spot_check.SpotCheck.ask)
        self.ask: Callable[[int, Message], dict[str, np.ndarray]] | None = None
        self.task_ids = itertools.count(1)

    def link(self, k: int) -> LinkSpeed:
        """Worker ``k``'s link (nothing measured yet for a new one)."""
        return self.links.setdefault(k, LinkSpeed())

    def op(
        self,
        what: str,
        backend: Backend,
        fields: dict[str, int] | None = None,
        timeout: float | None = None,
        codec: Narrowing | None = None,
        expect: dict[int, float] | None = None,
        units: dict[int | None, int] | None = None,
    ) -> Op:
        """A new op named ``what`` in errors ("forward of conv2"), the master's share on ``backend``; its tasks
        carry ``fields`` (a layer's step and index); ``expect`` and ``units``: :meth:`Op.expected`."""
        return Op(self, what, backend, fields or {}, timeout or self.timeout, codec, expect or {}, units)


class _Sent(NamedTuple):
    """A task sent, not yet gathered."""

    worker: int
    msg: Message  # as the op built it, float32
    wire: Message  # as it was sent (encoded)
    at: float  # the Rpc's clock when it was sent
    alone: bool  # the worker had no other task of the op: its result's wait is its own link and compute


class Op:
    """The tasks of one distributed op, and what it cost: bytes, each worker's compute, the master's."""

    def __init__(
        self, rpc: Rpc, what: str, backend: Backend, fields: dict[str, int], timeout: float, codec: Narrowing | None,
        expect: dict[int, float], units: dict[int | None, int] | None,
    ) -> None:  # fmt: skip
        self.rpc, self.what, self.backend, self.fields, self.timeout = rpc, what, backend, fields, timeout
        self.codec, self.expect, self.units = codec, expect, units  # codec None: the arrays go as they are, float32
        self._started: dict[int, float] = {}  # task -> when its "started" came, until its "computed"
        self.fallbacks = 0  # arrays sent or received not as the codec was asked (float32: a narrower word overflowed)
        self.t0, self.step = time.perf_counter(), fields.get("step")  # its tasks' step (None: a calibration's)
        self.times = Times()  # when each participant's tasks went, started, computed and came back
        self._pending: dict[int, _Sent] = {}  # task -> how it was sent, not yet gathered
        self._early: dict[int, Message] = {}  # task -> its result, come before its gather
        self.sent: dict[int, int] = {}  # worker -> array bytes sent to it
        self.recv: dict[int, int] = {}
        self.compute: dict[int, float] = {}  # worker -> seconds it reported
        self.master_s = 0.0
        self.waited_s = 0.0  # the master blocked, waiting for a result: the rest of the op's wall it was busy
        self.chunks = 1  # the pieces a split sends its transfers in, each beside the next one's compute (OpStats)

    def send(self, worker: int, msg: Message) -> int:
        """Send ``msg`` (float32 arrays) to ``worker`` as a new task, encoded by the op's codec; its task id."""
        task = next(self.rpc.task_ids)
        msg.header.update(self.fields, task=task)
        if self.rpc.ask is not None and self.codec is None:  # a narrowed op is not checked
            msg.arrays.update(self.rpc.ask(worker, msg))
        wire, fell_back = self.codec.encode(msg) if self.codec else (msg, 0)
        self.fallbacks += fell_back
        at = self.rpc.clock()
        try:
            self.rpc.transport.send(worker, wire)
        except WorkerLost as e:
            raise Lost({worker: e.reason}) from None
        self.times.note(worker, "sent")
        alone = all(sent.worker != worker for sent in self._pending.values())
        self._pending[task] = _Sent(worker, msg, wire, at, alone)
        self.sent[worker] = self.sent.get(worker, 0) + wire.nbytes()
        return task

    @contextmanager
    def local(self) -> Iterator[None]:
        """Time the master's own share of the op (computed while the workers compute theirs)."""
        t = time.perf_counter()
        yield
        self.backend.synchronize()
        self.master_s += self.times.local(t)  # now - t, noted as the span of the master's compute

    def host(self, a: Array) -> np.ndarray:
        """A master's backend array as a C-contiguous float32 host array, to send (a view when it is one)."""
        return np.ascontiguousarray(self.backend.to_numpy(a), dtype=np.float32)

    def gather(self, tasks: Iterable[int], each: Callable[[int, Message], None] | None = None) -> dict[int, Message]:
        """The result of each task in ``tasks``, by worker, by its deadline; ``each(worker, result)`` as each comes."""
        waiting = set(tasks)
        results: dict[int, Message] = {}
        ceiling = self.rpc.clock() + self.timeout
        while waiting:
            task = next((t for t in waiting if t in self._early), None)
            if task is not None:
                reply = self._early.pop(task)
            else:
                task, reply = self._receive(ceiling, waiting)
                if task not in waiting:
                    continue
            worker = self._pending.pop(task).worker
            waiting.discard(task)
            results[worker] = reply
            if each is not None:
                each(worker, reply)
        return results

    def array(self, worker: int, reply: Message, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Array ``name`` of a worker's result, which must have ``shape``."""
        a = reply.arrays.get(name)
        if a is None or tuple(a.shape) != shape:
            got = "nothing" if a is None else f"shape {tuple(a.shape)}"
            why = f"returned {got} for {name!r} in the {self.what}, expected shape {shape} (the same tinyconv version?)"
            raise Lost({worker: why}, wrong=True)
        return a

    def expected(self, k: int) -> float | None:
        """e_k, worker k's expected compute seconds for its tasks of the op: ``expect``'s (by the last steps, the
        calibration); else, with ``units`` (participant, the master None -> its units of work, for an op whose
        shares are each computed in one go), its units at the pace of the first participant on k's backend that
        answered (one backend has the same first-run costs, OpenCL's kernel builds); None while nothing is known."""
        if k in self.expect or not self.units:
            return self.expect.get(k)
        kind = {j: w.backend for j, w in self.rpc.workers.items()} | {None: self.backend.name}
        took = {None: self.master_s, **self.compute}  # the master first, then the workers as they answered
        same = [j for j, s in took.items() if kind.get(j) == kind.get(k) and s > 0 and self.units.get(j, 0) > 0]
        pace = next((took[j] / self.units[j] for j in same), None)
        return None if pace is None else pace * self.units.get(k, 0)

    def _receive(self, ceiling: float, waiting: set[int]) -> tuple[int, Message]:
        """The next result for one of this op's tasks (one not ``waiting`` is kept as early); a task's ``started``
        and ``computed`` on the way open and close its compute deadline."""
        waited = False  # since the master waited, it did nothing that takes time: what comes arrives now
        while True:
            k, reply, waited_now = self._next(ceiling, waiting)
            waited |= waited_now
            task = reply.header.get("task")
            ours = task in self._pending and self._pending[task].worker == k
            if not ours and self.rpc.aside is not None and self.rpc.aside(k, reply):  # a joiner's calibration
                continue
            if reply.kind == "error" and (task is None or ours):  # out of memory, a driver's error, ...
                raise Lost({k: f"failed the {self.what}: {reply.header['message']}"})
            if not ours:  # a late answer to an op given up on
                log.debug("ignoring a stale %s from worker %d (task %r)", reply.kind, k, task)
                continue
            self.times.note(k, reply.kind)  # "started", "computed" or "result": when the master read it
            if reply.kind == "started":
                self._started[task] = self.rpc.clock()
                continue
            if reply.kind == "computed":  # its result is on the way: its bytes keep the worker alive
                self._started.pop(task, None)
                continue
            if reply.kind != "result":
                raise Lost({k: f"answered the {self.what} with a {reply.kind!r}"}, wrong=True)
            sent, nbytes = self._pending[task], reply.nbytes()
            try:
                reply, fell_back = self.codec.decode(reply, sent.wire) if self.codec else (reply, 0)  # float32 now
                check_result(reply, sent.msg.kind)
            except RuntimeError as e:
                raise Lost({k: f"sent a malformed result for the {self.what}: {e}"}, wrong=True) from None
            self.fallbacks += fell_back
            _check_finite(k, reply, sent.msg, self.what)
            if self.rpc.check is not None and self.codec is None:  # narrowed words round beyond float32's
                self.rpc.check(k, sent.msg, reply, self.backend)
            compute = float(reply.header["compute_s"])
            self.recv[k] = self.recv.get(k, 0) + nbytes
            self.compute[k] = self.compute.get(k, 0.0) + compute
            if sent.alone and waited:  # it arrived now: the time beyond its compute was its link's
                self.rpc.link(k).add(nbytes + sent.wire.nbytes(), self.rpc.clock() - sent.at - compute, self.step)
            if task not in waiting:
                self._early[task] = reply
            return task, reply

    def _limits(self, ceiling: float, waiting: set[int]) -> list[tuple[float, int, str]]:
        """(when, worker, why) for each task of ``waiting``: it is lost at ``ceiling`` unless its result comes,
        or, while it computes, at its ``started`` + 2 e_k + 1 s (:meth:`expected`)."""
        limits = []
        for task in waiting:
            k = self._pending[task].worker
            e = self.expected(k) if task in self._started else None
            when = ceiling if e is None else min(ceiling, self._started[task] + 2 * e + 1)
            why = f"2 x its expected {e:.3g} s of compute + 1 s" if when < ceiling else f"{self.timeout:g} s"
            limits.append((when, k, f"no result for the {self.what} within {why}"))
        return limits

    def _next(self, ceiling: float, waiting: set[int]) -> tuple[int, Message, bool]:
        """The next message from a worker, and whether the master waited for it (it arrived now), or not
        (it came while the master was busy); Lost for the workers past their limits (:meth:`_limits`)."""
        waited = False
        while True:
            t, timeout = self.rpc.clock(), 0.0
            if waited:  # nothing came since the master looked: the deadlines are what is left
                limits = self._limits(ceiling, waiting)
                if overdue := {k: why for when, k, why in limits if when <= t}:
                    raise Lost(overdue)
                timeout = min(limits)[0] - t
            try:
                return *self.rpc.transport.recv(timeout=timeout), waited
            except TimeoutError:
                waited = True
            except WorkerLost as e:
                if any(self._pending[task].worker == e.worker for task in waiting):
                    raise Lost({e.worker: e.reason}) from None
                log.debug(
                    "worker %d lost (%s) with no task in the %s: its next send says so", e.worker, e.reason, self.what
                )
            finally:
                self.waited_s += self.rpc.clock() - t


def _check_finite(k: int, reply: Message, sent: Message, what: str) -> None:
    """A worker that answers finite inputs with a NaN or an infinity is not to be trusted: Lost. (From
    non-finite inputs -- a diverged model -- the master's own numbers are no better: let them through.)"""
    bad = [name for name, a in reply.arrays.items() if not np.isfinite(a).all()]
    if bad and all(np.isfinite(a).all() for a in sent.arrays.values()):
        raise Lost({k: f"returned non-finite values in {', '.join(bad)} for the {what}, from finite inputs"}, True)
