"""A worker's link as its recent tasks measured it: seconds per array byte beyond its compute.

``rpc.py`` files a sample for every task a worker had to itself and the master waited for;
``runtime.py`` hands the rebalancer (``rebalance.py``) the estimates.
"""

from __future__ import annotations

import statistics
from collections import deque


class LinkSpeed:
    """One worker's link.

    A task of b bytes (its arrays and its result's), sent at t_send, whose result the master
    received at t_recv after c seconds of the worker's compute, gives one sample::

        s = (t_recv - t_send - c) / b          seconds per byte: transfers, (de)serialising, queues

    Only when the master was waiting for that result, so that t_recv is its arrival: one that had
    come while the master was busy (with its own share, or another result) arrived earlier, and
    says only an upper bound. Latency makes small tasks look slow per byte: that errs towards more
    time. Estimates are medians, so one stall does not count. A worker's first step is not filed: it pays for
    first use, and where the master finishes last no later task is waited for, so its sample would stand alone.
    """

    WINDOW = 20  # samples kept

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=self.WINDOW)
        self.first: int | None = None  # the step of its first task that had one (a calibration's has none)

    def add(self, nbytes: int, seconds: float, step: int | None = None) -> None:
        """File a task's ``nbytes`` and ``seconds`` beyond its compute (not without bytes, nor of the first step)."""
        self.first = step if self.first is None else self.first
        if nbytes > 0 and (step is None or step != self.first):
            self.samples.append(max(0.0, seconds) / nbytes)

    def seconds_per_byte(self) -> float | None:
        """The median sample; None before there is one."""
        return statistics.median(self.samples) if self.samples else None
