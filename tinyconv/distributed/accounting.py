"""What a distributed step cost: the paper's comm / conv split, bytes, and each participant's time.

Every list here is in participant order (the master first if it takes part, then the workers). For one *op* (the
forward or the backward of one sharded layer), conv_s is the slowest participant's compute and comm_s the rest
of the op's wall time on the master (docs/how-it-works.md, "What a step costs"). Bytes are the arrays of the tasks
and results (``Message.nbytes``), counted the same for every transport; headers, framing, heartbeats and
calibration are not (``transport.traffic()`` has the zmq totals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

# [sent_s, started_s, computed_s, received_s]: seconds from the op's start, each None where not known
Span = list[float | None]
MOMENTS = ("sent", "started", "computed", "result")  # what Times.note takes: the last is the result's arrival


@dataclass
class OpStats:
    """One distributed forward or backward of one layer."""

    names: list[str]  # the participants, in order
    wall_s: float  # from the start of the op to its assembled result, on the master
    compute_s: list[float]  # per participant (0 for those without kernels)
    sent: list[int]  # array bytes to each participant (0 for the master)
    recv: list[int]  # and from it
    fallbacks: int = 0  # arrays that went in float32 as their narrower wire format would have overflowed
    master_waited_s: float = 0.0  # the master blocked on results; wall_s - this: the master busy (compute and I/O)
    chunks: int = 1  # the pieces its transfers went in, each beside the next one's compute (by_channels' pipeline)
    at: float | None = None  # its start on the master's clock (time.perf_counter), which its spans count from
    spans: list[Span] | None = None  # per participant: when its tasks went, started, computed, came back (Times)

    def moved(self, name: str) -> int:
        """Array bytes to and from participant ``name``."""
        return int(self.of(name, "sent") + self.of(name, "recv"))

    def of(self, name: str, field: str) -> float:
        """``field`` (compute_s, sent or recv) of participant ``name``; 0 if it had no part in the op."""
        return getattr(self, field)[self.names.index(name)] if name in self.names else 0

    def span(self, name: str) -> Span:
        """Participant ``name``'s span; all None if it had no part in the op or nothing was timed."""
        return list(self.spans[self.names.index(name)]) if self.spans and name in self.names else [None] * 4

    @classmethod
    def from_op(cls, op: Any, placement: list[tuple[str, int | None]]) -> OpStats:
        """What ``op`` (an ``rpc.Op``) cost so far, in participant order (placement: (name, worker index or None))."""
        return cls(
            names=[name for name, _ in placement],
            wall_s=time.perf_counter() - op.t0,
            compute_s=[op.master_s if k is None else op.compute.get(k, 0.0) for _, k in placement],
            sent=[0 if k is None else op.sent.get(k, 0) for _, k in placement],
            recv=[0 if k is None else op.recv.get(k, 0) for _, k in placement],
            fallbacks=op.fallbacks,
            master_waited_s=op.waited_s,
            chunks=op.chunks,
            at=op.t0,
            spans=op.times.spans(op.t0, [k for _, k in placement]),
        )

    @property
    def conv_s(self) -> float:
        return max(self.compute_s)

    @property
    def comm_s(self) -> float:
        return max(0.0, self.wall_s - self.conv_s)


class Times:
    """When each participant's part of an op happened, on the master's clock (``time.perf_counter``): the first
    of its tasks handed to the transport, the first ``started`` read from it, the last ``computed``, the last
    result; for the master (None) the start and end of its own compute. A worker with several tasks in the op
    (the pipeline's chunks, a second round) gets one span over them all."""

    def __init__(self) -> None:
        self.at: dict[int | None, Span] = {}  # participant -> its moments, absolute

    def note(self, k: int | None, moment: str, t: float | None = None) -> None:
        """Worker ``k``'s ``moment`` (one of MOMENTS; any other is ignored) happened at ``t``, by default now."""
        if moment in MOMENTS:
            i, span = MOMENTS.index(moment), self.at.setdefault(k, [None] * 4)
            if i >= 2 or span[i] is None:  # the first task's send and start, the last one's compute and result
                span[i] = time.perf_counter() if t is None else t

    def local(self, start: float) -> float:
        """The master computed its own share from ``start`` to now: for how many seconds."""
        end = time.perf_counter()
        for moment, t in zip(MOMENTS, (start, start, end, end), strict=True):
            self.note(None, moment, t)
        return end - start

    def spans(self, t0: float, participants: list[int | None]) -> list[Span]:
        """Each of ``participants``' span in seconds from ``t0``."""
        return [[None if t is None else t - t0 for t in self.at.get(k, [None] * 4)] for k in participants]


@dataclass
class LayerStep:
    """One layer's forward and backward in a training step."""

    name: str
    counts: list[int]  # kernels per participant
    channels: list[int] | None  # input channels per participant, for a layer split by them
    forward: OpStats
    backward: OpStats
    images: int  # the batch it ran on

    @property
    def units(self) -> list[int]:
        """What the layer is split by: its input channels when it is split by them, else its kernels."""
        return self.counts if self.channels is None else self.channels

    @property
    def compute_s(self) -> list[float]:
        """Each participant's forward + backward compute."""
        return [f + b for f, b in zip(self.forward.compute_s, self.backward.compute_s, strict=True)]

    def ready_s(self, seconds_per_byte: dict[str, float]) -> list[float]:
        """What the rebalancer balances: each participant's forward + backward time until its share is at
        the master. For each op, with compute c_i and transfers x_i = (bytes to and from i) * seconds_per_byte[i]
        (by name; 0 for the master, and for a worker lost since, whose link is gone) in k chunks, each chunk's
        transfer beside the next one's compute::

            t_i = max(c_i, x_i) + min(c_i, x_i) / k          (k = 1: c_i + x_i, one after the other)

        The master's c is all of its busy time in the op, wall - waited: its share's compute, and the sends,
        sums and copies of running the op, which its share waits behind as much."""
        ready = [0.0] * len(self.participants)
        for op in (self.forward, self.backward):
            for i, name in enumerate(self.participants):
                c = op.wall_s - op.master_waited_s if name == "master" else op.of(name, "compute_s")
                x = op.moved(name) * seconds_per_byte.get(name, 0.0)
                ready[i] += max(c, x) + min(c, x) / op.chunks
        return ready

    @property
    def participants(self) -> list[str]:
        return self.forward.names


def step_record(layers: list[LayerStep], participants: list[str]) -> dict[str, Any]:
    """The step's accounting (its keys: docs/metrics.md), from its layers in the order their backwards
    finished. ``ops`` are in the order they ran: the forwards, then the backwards, which finish the layers in
    reverse. The lists are for ``participants``, those of the cluster when the step ended: a worker lost during
    the step no longer counts, one that joined counts 0."""
    ran = [(d.name, "forward", d.forward) for d in reversed(layers)]
    ran += [(d.name, "backward", d.backward) for d in layers]

    def shares(d: LayerStep, counts: list[int]) -> list[int]:
        by_name = dict(zip(d.participants, counts, strict=True))
        return [by_name.get(name, 0) for name in participants]

    return _record(ran, participants) | {
        "shares": {d.name: shares(d, d.counts) for d in reversed(layers)},
        "channel_shares": {d.name: shares(d, d.channels) for d in reversed(layers) if d.channels is not None},
    }


def batch_record(
    parallel: str, unit: str, stats: list[tuple[str, OpStats]], participants: list[str], counts: list[int]
) -> dict[str, Any]:
    """A step of a split of the batch, with :func:`step_record`'s keys (``stats``: (op name, its
    stats) in the order the ops ran; ``counts``: images per participant): its ``unit`` ("batch")
    stands for a layer in ``shares`` and ``ops``; ``rebalanced`` is the caller's."""
    record = _record([(unit, op, s) for op, s in stats], participants)
    return record | {"parallel": parallel, "shares": {unit: list(counts)}, "channel_shares": {}, "rebalanced": {}}


def _record(ran: list[tuple[str, str, OpStats]], participants: list[str]) -> dict[str, Any]:
    """What every step's record says of its ops, (layer, "forward" or another op name, its stats) as they ran."""
    ops = [stats for _, _, stats in ran]
    start = min((op.at for op in ops if op.at is not None), default=0.0)  # the step's first op's: the step's start

    def each(field: str, only: list[OpStats] = ops) -> list:
        return [sum(op.of(name, field) for op in only) for name in participants]

    def entry(layer: str, op: str, s: OpStats) -> dict[str, Any]:
        compute, waited = each("compute_s", [s]), s.master_waited_s
        at = None if s.at is None else s.at - start
        spans = [s.span(name) for name in participants]
        times = {"at_s": at, "spans": spans}
        return {"layer": layer, "op": op, "wall_s": s.wall_s, "compute_s": compute, "master_waited_s": waited} | times

    return {
        "comm_s": sum(op.comm_s for op in ops),
        "conv_s": sum(op.conv_s for op in ops),
        "bytes_sent": sum(sum(op.sent) for op in ops),
        "bytes_recv": sum(sum(op.recv) for op in ops),
        "wire_fallbacks": sum(op.fallbacks for op in ops),
        "participant_bytes_sent": each("sent"),
        "participant_bytes_recv": each("recv"),
        "participants": list(participants),
        "participant_conv_s": each("compute_s"),
        "ops": [entry(*op) for op in ran],
    }
