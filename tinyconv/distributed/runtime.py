"""What every parallelism shares: who takes part, how work is shared out, and what a step recorded.

The model split (``shard/cluster.py``: kernels and input channels of each layer) and the splits of
the batch (``replica/batch.py``: images) are each a :class:`Runtime`; each names its *units*, what it
shares out. The placement is ``(name, worker index)``, the master first (index ``None``) if it takes
part, then the workers by index: the order of every list in plans, metrics and sums. A worker lost or
joining late: docs/how-it-works.md, "When workers come and go".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from backends.base import Backend
from tinyconv.distributed.calibrate import calibration_timeout
from tinyconv.distributed.heap import release_freed_memory
from tinyconv.distributed.joiners import Joiners
from tinyconv.distributed.rebalance import Rebalancer
from tinyconv.distributed.rpc import Lost, Rpc
from tinyconv.distributed.shard.balance import speed_weights
from tinyconv.model import Network
from transports.base import Transport, WorkerInfo

log = logging.getLogger(__name__)

MASTER_SHARES = ("auto", "0")


def describe(info: WorkerInfo) -> str:
    """A worker, for a log line: its index, backend, device and host."""
    where = info.hostname or info.address or "?"
    return f"worker {info.index} ({info.backend} on {info.device.get('device', '?')} at {where})"


class Runtime:
    """The master (on ``backend``) and ``workers`` (on ``transport``) sharing a network's work.

    ``master_share``: "auto" -- the master computes a share too, sized by its speed like any
    worker's; "0" -- it only coordinates. ``rebalance``: follow the measured times, compute and
    transfers (``rebalancer`` to tune it). ``recv_timeout``: seconds every worker has to answer one
    op or its calibration at most. ``calibration_repeats``: timed runs per participant (their median).
    ``image_size``: the side of the images it calibrates on. ``spot_check``: the master checks samples of each
    worker's results within this fraction of its work (its split's ``checker``) and loses a worker whose numbers
    are wrong; 0 trusts them.

    A subclass sets ``parallel`` (the metrics' name for it), ``splits`` (what its plans count) and writes
    ``train_batch``; ``_units()``, what is shared out in order (the attached layers' names, or ["batch"]);
    ``_apportion(unit, weights)``, ``unit`` split among the placement in proportion to ``weights`` (into ``counts``,
    and ``channel_counts`` for a layer split by them), returning how many of what the rebalancer moves the unit
    has; ``_time_all(net, batch_size)``, every participant's seconds on each unit for ``batch_size`` images (name ->
    unit -> s); ``_joiner_task()``, the calibration task a joiner is timed by and the times it answers, and
    ``_joiner_timings(times)``, those as unit -> s.
    """

    parallel = "?"  # "model", "data", "hybrid"
    splits = "?"  # what a plan counts: "kernels" or "images"
    checker: Callable[[float], Any]  # the spot check of its split: spot_check.SpotCheck, replay_check.ReplayCheck

    def __init__(
        self,
        transport: Transport,
        workers: Sequence[WorkerInfo],
        backend: Backend,
        master_share: str = "auto",
        rebalance: bool = True,
        rebalancer: Rebalancer | None = None,
        recv_timeout: float = 120.0,
        calibration_repeats: int = 3,
        image_size: int = 32,
        spot_check: float = 0.03,
    ) -> None:
        if master_share not in MASTER_SHARES:
            raise ValueError(
                f"master_share must be 'auto' (the master computes a share too) or '0' (it only "
                f"coordinates), got {master_share!r}"
            )
        if not workers and master_share == "0":
            raise ValueError("no workers and master_share '0': nobody would compute")
        if not (isinstance(calibration_repeats, int) and calibration_repeats >= 1):
            raise ValueError(f"calibration_repeats must be an int >= 1, got {calibration_repeats!r}")
        self.transport, self.backend = transport, backend
        self.workers = sorted(workers, key=lambda w: w.index)
        self.rpc = Rpc(transport, self.workers, recv_timeout)
        self.spot = self.checker(spot_check) if spot_check else None  # raises ValueError for a bad fraction
        self.rpc.check, self.rpc.ask = self.spot, getattr(self.spot, "ask", None)
        self.placement: list[tuple[str, int | None]] = [("master", None)] if master_share == "auto" else []
        self.placement += [(f"worker{w.index}", w.index) for w in self.workers]
        self.rebalancer = (rebalancer or Rebalancer()) if rebalance else None
        self.recv_timeout, self.calibration_repeats = float(recv_timeout), calibration_repeats
        self.image_size = image_size
        self.counts: dict[str, list[int]] = {}  # unit (a layer, "batch") -> its count per participant
        self.channel_counts: dict[str, list[int]] = {}  # layer -> input channels per participant, if split by them
        self.timings: dict[str, dict[str, float]] = {}  # participant -> unit -> calibrated seconds
        self.step = 0  # finished training steps
        self.last_step: dict[str, Any] | None = None  # the last finished step's record (accounting.py)
        self.calibration: dict[str, Any] | None = None
        self.lost: dict[int, str] = {}  # worker index -> why it is no longer a participant
        self.joiners = Joiners(self.rpc)  # the workers that joined late, timing themselves
        self.gave: set[int] = set()  # the workers whose answers this step has taken
        self.tainted = False  # one of them was found wrong since: the model split runs the step again
        self.events: list[dict[str, Any]] = []  # what happened to the participants, for the metrics file
        self.on_close: Callable[[], None] | None = None  # e.g. stopping the workers distribute() started

    @property
    def participants(self) -> list[str]:
        """Participant names in plan order: "master" (if it takes part), "worker0", ..."""
        return [name for name, _ in self.placement]

    def pop_events(self) -> list[dict[str, Any]]:
        """The events recorded since the last call (each a dict with an "event" key), oldest first."""
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        """Let go of the network (``_release``), then ``on_close`` (stops the workers distribute() started)."""
        self._release()
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        """Let go of the network on close (the model split puts its own layers back)."""

    # ---- shares -------------------------------------------------------------------------------
    def calibrate(self, net: Network, batch_size: int) -> dict[str, Any]:
        """Time every participant on each unit for ``batch_size`` images and split each by eq. 1. The
        times also go to the rebalancer as each participant's for the whole unit: with the first step's,
        at the calibrated split, it has two counts to fit a fixed and a per-unit cost by. Returns, and keeps::

            {"participants": [...], "times": {unit: [s, ...]}, "shares": {unit: [count, ...]},
             "channel_shares": {layer: [channels, ...]}}    # layers split by input channels
        """
        while True:
            try:
                times = self._time_all(net, batch_size)
                break
            except Lost as e:  # failed, silent or gone while timed: lost as in a step, and the others timed again
                if set(e.workers) <= set(self.lost):
                    raise
                self.lose(e.workers, refuse=True)  # failed its calibration: refused for a while
        release_freed_memory()  # the timings' whole layers, kept, would stay the run's peak (heap.py)
        self.timings = {name: times[name] for name in self.participants}
        result: dict[str, Any] = {"participants": self.participants, "times": {}, "shares": {}, "channel_shares": {}}
        for unit in self._units():
            result["times"][unit] = [times[name][unit] for name in self.participants]
            self._share(unit, result["times"][unit])
            result["shares"][unit] = list(self.counts[unit])
            if unit in self.channel_counts:
                result["channel_shares"][unit] = list(self.channel_counts[unit])
        self.calibration = result
        return result

    def _share(self, unit: str, times: list[float | None]) -> None:
        """``unit`` split by eq. 1 on ``times`` (equally where one is missing); with all of them,
        the rebalancer's first (count, seconds): each participant measured on the whole unit."""
        weights = speed_weights(times) if None not in times else [1.0] * len(times)
        total = self._apportion(unit, weights)
        if self.rebalancer is not None and None not in times:
            self.rebalancer.record(unit, [total] * len(times), times)

    def _replan(self) -> None:
        """Every unit split among the participants now by eq. 1 on their calibrated times, and a
        rebalancer that starts afresh from those times."""
        if self.rebalancer is not None:
            self.rebalancer = self.rebalancer.fresh()
        for unit in self._units():
            self._share(unit, [self.timings.get(name, {}).get(unit) for name in self.participants])

    def _links(self) -> dict[str, float]:
        """Each participant's measured seconds per byte, by name (0 for the master and for a link not yet measured)."""
        return {name: 0.0 if k is None else self.rpc.link(k).seconds_per_byte() or 0.0 for name, k in self.placement}

    def _expect(
        self, unit: str, units: dict[int | None, int], scale: float, per_unit: dict[str, float]
    ) -> dict[int, float]:
        """Worker -> its expected compute seconds for an op of ``unit`` (``units``: participant -> its units of it):
        at ``per_unit``, its seconds per unit in the last steps; else, calibrated, its part of its time t_k for
        the whole unit, ``scale`` * t_k * units_k / all units (scale = max(1, batch / calibrated batch)). The op
        gives a task 2 e_k + 1 s to compute (``rpc.py``): a worker that hangs while its heartbeats flow costs
        no more. A worker neither knows is not in it."""
        total, expect = sum(units.values()), {}
        for name, k in self.placement:
            n, t = units.get(k, 0), self.timings.get(name, {}).get(unit)
            if k is not None and n and name in per_unit:
                expect[k] = per_unit[name] * n
            elif k is not None and n and t is not None:
                expect[k] = scale * t * n / total
        return expect

    # ---- membership -----------------------------------------------------------------------------
    def lose(self, workers: dict[int, str], refuse: bool = False) -> None:
        """``workers`` (index -> why) are no longer participants: their shares go to the others, and the transport
        lets them go (they may come back as joiners). ``refuse``: their answers were wrong or their calibration
        failed, so it turns them away for a while."""
        for k, why in workers.items():
            if k in self.lost:
                continue
            self.lost[k] = why
            if refuse:
                self.transport.refuse(k, why)
                self.tainted |= k in self.gave  # its earlier answers this step went on unchecked
            else:  # it may still be connected (hung past its deadline): let it go, to come back as a joiner
                self.transport.drop(k, why)
            log.warning("%s lost: %s; its work goes to the others", describe(self.rpc.workers[k]), why)
            self.placement = [place for place in self.placement if place[1] != k]
            self.workers = [w for w in self.workers if w.index != k]
            if not self.placement:  # the master holds every weight: it can always finish alone
                self.placement = [("master", None)]
            self._replan()
            self.events.append({"event": "worker_lost", "step": self.step, "worker": f"worker{k}", "reason": why,
                                "shares": self._shares()})  # fmt: skip

    def _welcome_joiners(self) -> None:
        """At a step boundary: ask the workers that joined the transport since the last one to time
        themselves (``joiners.py``), and seat those whose answers came; leave out those that failed."""
        for info in self.transport.joined():
            self.rpc.workers[info.index] = info
            if self.calibration is None:
                self._seat(info)
                continue
            task, n = self._joiner_task()
            known = min((sum(t.values()) for t in self.timings.values()), default=None)  # the fastest's, all units
            try:
                self.joiners.ask(info, task, n, calibration_timeout(self.rpc, task, known))
            except Lost as e:
                self._left_out(info, e.workers[info.index])
        if self.joiners.waiting:
            self.lose(self.joiners.collect())
        for info, got in self.joiners.done():
            if isinstance(got, str):
                self._left_out(info, got)
            else:
                self.timings[f"worker{info.index}"] = self._joiner_timings(got)
                self._seat(info)

    def _seat(self, info: WorkerInfo) -> None:
        """A joiner, timed (once calibrated), given a share."""
        name = f"worker{info.index}"
        self.workers.append(info)
        self.placement.append((name, info.index))
        self._replan()
        log.info("%s joined: %s on %s", name, info.backend, info.device.get("device", "?"))
        self.events.append({"event": "worker_joined", "step": self.step, "worker": name, "backend": info.backend,
                            "device": info.device.get("device", "?"), "host": info.hostname,
                            "shares": self._shares()})  # fmt: skip

    def _left_out(self, info: WorkerInfo, why: str) -> None:
        """A joiner that failed its timing: never seated, lost with the reason."""
        self.lost[info.index] = why
        self.transport.refuse(info.index, f"joined, then {why}")
        log.warning("%s joined but could not be timed (%s); it is left out", describe(info), why)
        self.events.append({"event": "worker_lost", "step": self.step, "worker": f"worker{info.index}",
                            "reason": f"joined, then {why}", "shares": self._shares()})  # fmt: skip

    def _shares(self) -> dict[str, list[int]]:
        return {unit: list(c) for unit, c in self.counts.items()}
