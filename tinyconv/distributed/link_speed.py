"""A worker's link as its recent tasks measured it: seconds per array byte beyond its compute.

``rpc.py`` files a sample for every task a worker had to itself; ``runtime.py`` hands the rebalancer
(``rebalance.py``) the exact estimates, and the deadlines (``shard/cluster.py``, ``replica/batch.py``)
read the upper bounds too.
"""

from __future__ import annotations

import statistics
from collections import deque


class LinkSpeed:
    """One worker's link.

    A task of b bytes (its arrays and its result's), sent at t_send, whose result the master
    received at t_recv after c seconds of the worker's compute, gives one sample::

        s = (t_recv - t_send - c) / b          seconds per byte: transfers, (de)serialising, queues

    It is *exact* when the master was waiting for that result, so t_recv is its arrival; when
    it had come while the master was busy (with its own share, or another result), t_recv is
    later and s only an upper bound. Latency makes small tasks look slow per byte: that errs
    towards more time. Estimates are medians, so one stall does not count.
    """

    WINDOW = 20  # samples kept of each kind

    def __init__(self) -> None:
        self.exact: deque[float] = deque(maxlen=self.WINDOW)
        self.bounds: deque[float] = deque(maxlen=self.WINDOW)

    def add(self, nbytes: int, seconds: float, exact: bool) -> None:
        """File one task's ``nbytes`` and its ``seconds`` beyond the worker's compute (none without bytes)."""
        if nbytes > 0:
            (self.exact if exact else self.bounds).append(max(0.0, seconds) / nbytes)

    def seconds_per_byte(self, exact: bool = True) -> float | None:
        """The median exact sample; with ``exact=False`` the median of every sample, upper bounds
        too (enough for a deadline, where too much is safe). None before there is one."""
        samples = [*self.exact, *([] if exact else self.bounds)]
        return statistics.median(samples) if samples else None
