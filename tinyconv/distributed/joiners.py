"""Workers that join mid-run, timed beside the running steps, never blocking one.

At a step boundary the runtime sends a joiner its calibration task with no op waiting for it
(:meth:`Joiners.ask`); its answer is taken whenever a message comes in -- by a step's op, which
hands what no op of its own waits for to ``Rpc.aside``, or by :meth:`Joiners.collect` between
steps -- and at a step boundary after it came, :meth:`Joiners.done` says the joiner is timed (the
runtime seats it) or has failed: an error, times it cannot read, no answer by its deadline, or gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from tinyconv.distributed.calibrate import checked_times
from tinyconv.distributed.rpc import Lost, Rpc
from transports.base import Message, WorkerInfo, WorkerLost
from transports.wire import PROGRESS


@dataclass
class _Joiner:
    info: WorkerInfo
    task: int  # the calibration's task id
    times: int  # how many seconds its answer must give
    deadline: float  # monotonic
    timeout: float
    reply: Message | None = None
    gone: str | None = None


class Joiners:
    """The joiners timing themselves, on ``rpc`` (whose replies no op waits for come here)."""

    def __init__(self, rpc: Rpc) -> None:
        self.rpc = rpc
        self.waiting: dict[int, _Joiner] = {}  # worker index -> its timing
        rpc.aside = self._take

    def ask(self, info: WorkerInfo, task: Message, times: int, timeout: float) -> None:
        """Send joiner ``info`` its calibration ``task``, to answer with ``times`` seconds within ``timeout``
        (raises Lost if it is gone already)."""
        k = info.index
        task.header["task"] = sent = next(self.rpc.task_ids)
        try:
            self.rpc.transport.send(k, task)
        except WorkerLost as e:
            raise Lost({k: e.reason}) from None
        self.waiting[k] = _Joiner(info, sent, times, time.monotonic() + timeout, timeout)

    def collect(self) -> dict[int, str]:
        """Take what has come in, without waiting; the participants the transport lost meanwhile, index -> why."""
        lost = {}
        while True:
            try:
                k, reply = self.rpc.transport.recv(timeout=0.0)
            except TimeoutError:
                return lost
            except WorkerLost as e:
                if e.worker in self.waiting:
                    self.waiting[e.worker].gone = e.reason
                else:
                    lost[e.worker] = e.reason
                continue
            self._take(k, reply)  # anything else is a stale answer to an op given up on

    def done(self) -> Iterator[tuple[WorkerInfo, list[float] | str]]:
        """The joiners done timing: (info, their seconds), or (info, why they failed)."""
        now = time.monotonic()
        for k, j in list(self.waiting.items()):
            if j.reply is None and j.gone is None and now < j.deadline:
                continue  # still timing itself
            del self.waiting[k]
            try:
                if j.reply is None:
                    raise Lost({k: j.gone or f"did not answer its calibration within {j.timeout:g} s"})
                yield j.info, checked_times(k, j.reply, "calibration", j.times)
            except Lost as e:
                yield j.info, e.workers[k]

    def _take(self, k: int, reply: Message) -> bool:
        """Whether ``reply`` answers joiner k's calibration (then it is kept)."""
        j = self.waiting.get(k)
        if j is None or reply.header.get("task") != j.task or reply.kind in PROGRESS:  # "started": no answer yet
            return False
        j.reply = reply
        return True
