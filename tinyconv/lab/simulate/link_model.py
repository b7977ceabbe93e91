"""The link between the master and its workers: how long one distributed op takes on the wire.

One op is the forward or the backward of one sharded layer (``tinyconv/distributed/rpc.py``). The
master sends every worker with kernels its task, one message each, in worker order (ZeroMQ's
ROUTER sends a copy per worker: no broadcast, no multicast), computes its own share meanwhile,
and waits for every result. A worker starts when its whole task has arrived, and replies when
it has computed. So transfers overlap *other* participants' compute, never the same worker's,
and nothing overlaps across ops: the next layer needs this one's result. (The split by input
channels overlaps a second round with the first, ``by_channels.relay``; its two rounds are modelled as
one op each way here.)

With B the bandwidth (bytes/s), L the latency per message (s), and for worker j in send order
to_j the bytes of its task, t_j its compute and back_j the bytes of its result:

``wifi`` -- one shared, half-duplex channel. Every transfer, either way, holds the channel for
L + bytes/B, one after another; the tasks (queued at the master at once) go first, then the
results in the order the workers finish::

    s_j = sum_{i <= j} (L + to_i / B)                    worker j has its task
    e_j = s_j + t_j                                      and its result ready
    c_0 = s_last;  c = max(c, e_j) + L + back_j / B      results, by e_j ascending
    wall = max(c_last, t_master)

``ethernet`` -- switched, full duplex: each worker's link is its own, so the master's NIC is
the bottleneck, one queue each way: its uplink carries every task (the input x once per
worker: a switch does not broadcast for it), its downlink every result, at the same time. L is
a delay that holds no link::

    s_j = sum_{i <= j} to_i / B + L
    e_j = s_j + t_j
    d_0 = 0;  d = max(d, e_j) + back_j / B              results, by e_j ascending
    wall = max(d_last + L, t_master)

A worker behind a slower link of its own, B_j < B (``LinkModel.workers``: a worker on Wi-Fi or
behind a shaped link, the others on the master's LAN), holds its transfers to its rate: on ``wifi``
each of its transfers holds the channel for L + bytes/B_j; on ``ethernet`` its task arrives no
sooner than to_j/B_j after the master started sending, and its result is in no sooner than
back_j/B_j after it is ready, while the master's NIC carries the others' bytes meanwhile.

With one worker both give L + to/B + t + L + back/B. With n equal workers and little compute,
wifi takes about sum(to + back)/B + 2nL, ethernet about max(sum to, sum back)/B: the shared
medium pays for both directions, the switched one for the larger. Protocol overhead (headers,
TCP, 802.11 framing) is not modelled: B is the payload rate actually achieved.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MEDIA = ("wifi", "ethernet")
MB = 1e6  # the paper's MB/s: 10^6 bytes


@dataclass(frozen=True)
class LinkModel:
    """A link model: ``medium`` (wifi or ethernet), ``bandwidth`` bytes/s, ``latency`` s per message; ``workers``:
    each worker's own link (bytes/s) in worker order, where one is slower (a worker beyond them: ``bandwidth``)."""

    medium: str
    bandwidth: float
    latency: float = 0.0
    workers: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.medium not in MEDIA:
            raise ValueError(f"medium must be one of {', '.join(MEDIA)}, got {self.medium!r}")
        if not (self.bandwidth > 0 and self.latency >= 0 and all(b > 0 for b in self.workers)):
            raise ValueError(f"bandwidths must be > 0 and latency >= 0, got {self.bandwidth!r}, {self.latency!r}")

    def rate(self, worker: int) -> float:
        """Worker ``worker``'s rate, bytes/s: its own link's, no more than the master's (-1: the master's)."""
        own = self.workers[worker] if 0 <= worker < len(self.workers) else self.bandwidth
        return min(own, self.bandwidth)


@dataclass(frozen=True)
class Task:
    """One worker's part of an op: bytes to it, its compute (s), bytes back; which worker (its link's rate)."""

    to: int
    compute: float
    back: int
    worker: int = -1


def op_wall(link: LinkModel, master_s: float, tasks: Sequence[Task]) -> float:
    """Wall time of one op: the schedule in the module docstring, ``tasks`` in send order."""
    b, lat = link.bandwidth, link.latency
    shared = link.medium == "wifi"
    sent, ready = 0.0, []
    for task in tasks:
        own = link.rate(task.worker)
        sent += task.to / (own if shared else b) + (lat if shared else 0.0)
        arrived = sent if shared else max(sent, task.to / own) + lat  # its own link, beside the master's NIC
        ready.append((arrived + task.compute, task.back, own))
    if not tasks:
        return master_s
    busy = end = sent if shared else 0.0  # wifi: the results wait for the tasks to be out
    for at, back, own in sorted(ready, key=lambda r: r[0]):
        busy = max(busy, at) + back / (own if shared else b) + (lat if shared else 0.0)
        end = max(end, busy, at + back / own)
    return max(end + (0.0 if shared else lat), master_s)


def parse_rate(text: str) -> float:
    """'5MB/s', '12.5 MB/s', '40mbit', '1gbit', '100kB/s' -> bytes per second (MB = 10^6 bytes, as tc's
    and the paper's). A ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)(B/s|bit/s|bit)?\s*", text)
    if not m or not m.group(3):
        raise ValueError(f"rate {text!r} is not NUMBER UNIT, e.g. 5MB/s, 12.5MB/s, 40mbit or 1gbit")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    if m.group(3) != "B/s":  # bits
        value /= 8
    if not value > 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return value
