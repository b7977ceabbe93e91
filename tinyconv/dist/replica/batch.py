"""What every split of the batch needs, whatever each participant computes on its slice.

Data parallelism (``server.py``: whole replicas) and the hybrid (``hybrid.py``: the
convolutional part by data, the classifier on the master) both share each batch out by
images. Everything about *who* gets *how many* images is the same for both, and lives here
once, in :class:`BatchSplit`; each subclass says only what a step computes:

* the participants (``seats``): the master first if it takes part (``master_share="auto"``),
  then the workers by index -- the order of every list in the metrics and of every sum;
* calibration: everyone times one slice's work on the whole batch (the master locally, each
  worker with the subclass's calibration task), eq. 1 and largest remainder give whole images;
* the rebalancer, with images as its units: each participant's ready time is its compute
  plus its bytes at its link's measured rate, summed over the step's ops;
* a worker lost during a step (gone, silent past the timeout, non-finite numbers): its images
  go to the others by eq. 1 on their calibrated times and the step runs again from the start;
  a worker that joins is timed and given images at the next step;
* the step's record, with the model-parallel cluster's keys (``tinyconv/dist/accounting.py``):
  conv_s the slowest participant's compute summed over the step's ops, comm_s the rest of
  their wall time, bytes, shares {"batch": [images, ...]}.

A subclass sets ``parallel`` (the name in the metrics), ``calibrate_task`` (the task kind a
worker times itself with) and writes ``_time_own`` (the master's timing), ``_start`` (what a
re-run of the step starts again from) and ``_step`` (one attempt at the step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.dist.heap import release_freed_memory
from tinyconv.model import Network
from tinyconv.dist.replica.replica import spec_of
from tinyconv.dist.accounting import OpStats
from tinyconv.dist.shard.balance import apportion, speed_weights
from tinyconv.dist.calibrate import SLOWER
from tinyconv.dist.membership import Membership
from tinyconv.dist.rebalance import Rebalancer
from tinyconv.dist.rpc import Lost, Op, Rpc
from transports.base import Message, Transport, WorkerInfo

log = logging.getLogger(__name__)

UNIT = "batch"  # the name the image shares go by in plans, metrics and the rebalancer


class BatchSplit(Membership):
    """The master (on ``backend``) and ``workers`` (on ``transport``) sharing each batch by images.

    ``master_share``: "auto" -- the master computes a slice too, sized by its speed; "0" -- it
    only coordinates (and sums). ``rebalance``: follow the measured times (``rebalancer``);
    ``recv_timeout``: the most seconds a worker has to answer one op or its calibration.
    """

    splits = "images"  # what a checkpoint's plan counts (the model-parallel Cluster's: kernels)
    gives_away = "its images go"  # a lost worker's, in the log
    parallel = "?"  # the subclass's name for the metrics: "data", "hybrid"
    calibrate_task = "?"  # the task a worker times its slice's work with

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
    ) -> None:
        if master_share not in ("auto", "0"):
            raise ValueError(f"master_share must be 'auto' or '0', got {master_share!r}")
        if not workers and master_share == "0":
            raise ValueError("no workers and master_share '0': nobody would compute the slices")
        self.transport, self.backend = transport, backend
        self.workers = sorted(workers, key=lambda w: w.index)
        self.rpc = Rpc(transport, self.workers, recv_timeout)
        self.seats: list[tuple[str, int | None]] = [("master", None)] if master_share == "auto" else []
        self.seats += [(f"worker{w.index}", w.index) for w in self.workers]
        self.rebalancer = (rebalancer or Rebalancer()) if rebalance else None
        self.recv_timeout, self.calibration_repeats = float(recv_timeout), calibration_repeats
        self.image_size = image_size
        self.counts: dict[str, list[int]] = {}  # {"batch": images per participant}
        self.channel_counts: dict[str, list[int]] = {}  # none: a checkpoint's plan has the Cluster's keys
        self.timings: dict[str, float] = {}  # participant -> calibrated seconds for ``calibrated_batch`` images
        self.calibrated_batch = 0
        self.step = 0  # finished training steps
        self.last_step: dict[str, Any] | None = None
        self.calibration: dict[str, Any] | None = None
        self.lost: dict[int, str] = {}
        self.events: list[dict[str, Any]] = []
        self.on_close: Callable[[], None] | None = None
        self._moved: dict[str, int] = {}  # participant -> bytes its last step moved, for the timeout
        self._spec: dict[str, Any] | None = None

    @property
    def participants(self) -> list[str]:
        return [name for name, _ in self.seats]

    def pop_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()

    def __enter__(self) -> BatchSplit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what a subclass computes -------------------------------------------------------------
    def _time_own(self, spec: dict[str, Any], batch: int) -> float:
        """Seconds the master takes for a slice of ``batch`` images (on a copy of the network)."""
        raise NotImplementedError

    def _start(self, net: Network) -> Any:
        """What every attempt at a step starts from (packed once, before the first)."""
        raise NotImplementedError

    def _step(self, net: Network, x: np.ndarray, y: np.ndarray, start: Any, smoothing: float) -> tuple[float, Array]:
        """One attempt at the step: fills the grads for the loss label-smoothed by ``smoothing`` (0:
        the plain cross-entropy), returns (mean loss, logits on the master's backend), calls
        ``_finish``; raises Lost when a worker could not be counted on."""
        raise NotImplementedError

    # ---- shares -----------------------------------------------------------------------------
    def calibrate(self, net: Network, batch_size: int) -> dict[str, Any]:
        """Time every participant on its slice's work for ``batch_size`` images, split the batch by
        eq. 1. Returns, and keeps, {"participants", "times": {"batch": [s, ...]}, "shares":
        {"batch": [images, ...]}, "channel_shares": {}} (the model-parallel calibration's keys)."""
        spec = self._spec = spec_of(net, self.image_size)
        times: dict[str, float] = {}
        # the master first: a worker's deadline grows with what its run took (calibrate.SLOWER)
        for name, k in sorted(self.seats, key=lambda seat: seat[1] is not None):
            reference = min(times.values(), default=None)
            own = k is None
            times[name] = self._time_own(spec, batch_size) if own else self._time_worker(k, spec, batch_size, reference)
        release_freed_memory()  # each timed the whole batch; kept, it would stay the run's peak (tinyconv/dist/heap.py)
        times = {name: times[name] for name, _ in self.seats}
        self.timings, self.calibrated_batch = times, batch_size
        layer_times = [times[name] for name in self.participants]
        self.counts[UNIT] = apportion(speed_weights(layer_times), batch_size)
        if self.rebalancer is not None:  # each measured on the whole batch: its first (images, seconds)
            self.rebalancer.record(UNIT, [batch_size] * len(self.seats), layer_times)
        self.calibration = {"participants": self.participants, "times": {UNIT: layer_times},
                            "shares": {UNIT: list(self.counts[UNIT])}, "channel_shares": {}}  # fmt: skip
        return self.calibration

    def _time_worker(self, k: int, spec: dict[str, Any], batch: int, reference: float | None = None) -> float:
        """Worker k's seconds for ``batch`` images; ``reference``: a participant's, already timed."""
        timeout = self.rpc.timeout
        if reference is not None:  # 1 + repeats runs, each up to SLOWER times the reference's
            timeout = max(timeout, SLOWER * (1 + self.calibration_repeats) * reference)
        op = self.rpc.op(f"{self.parallel}-parallel calibration", self.backend, timeout=timeout)
        task = Message(self.calibrate_task, {"net": spec, "batch": batch, "repeats": self.calibration_repeats})
        got = op.gather([op.send(k, task)])[k].header["times"]
        if not (isinstance(got, list) and len(got) == 1 and isinstance(got[0], (int, float)) and got[0] > 0):
            raise RuntimeError(f"{self.rpc.describe(k)} answered {self.calibrate_task} with {got!r:.100}, "
                               "expected [seconds > 0]; is it running the same tinyconv version?")  # fmt: skip
        return float(got[0])

    def set_plan(self, layer: str, counts: Sequence[int], channels: Sequence[int] | None = None) -> None:
        """Use ``counts`` images per participant (``layer`` must be "batch") from the next step on."""
        if layer != UNIT or channels:
            raise ValueError(f"a {self.parallel}-parallel plan splits the {UNIT!r} by images, not {layer!r} by kernels")
        if len(counts) != len(self.seats) or any(c < 0 for c in counts) or sum(counts) == 0:
            raise ValueError(f"a plan needs {len(self.seats)} image counts >= 0 ({', '.join(self.participants)}), "
                             f"not all 0; got {list(counts)}")  # fmt: skip
        self.counts[UNIT] = [int(c) for c in counts]

    def shares(self, batch: int) -> list[int]:
        """Images per participant for a batch of ``batch``: the plan's, scaled by largest remainder
        when the batch is of another size (equal until calibrated)."""
        counts = self.counts.get(UNIT)
        if counts is None or len(counts) != len(self.seats):
            counts = self.counts[UNIT] = apportion([1.0] * len(self.seats), batch)
        if sum(counts) != batch:
            return apportion([float(c) for c in counts], batch)
        return list(counts)

    # ---- one step ---------------------------------------------------------------------------
    def train_batch(
        self, net: Network, x: Array | np.ndarray, y: np.ndarray, smoothing: float = 0.0
    ) -> tuple[float, Array]:
        """One forward + backward of ``net`` on the batch x (N, C, H, W), y (N,) shared by images: every
        parameter's grad is the whole batch's, as after ``net.train_step``; returns (the batch's mean
        loss, its logits on the master's backend). ``smoothing`` in [0, 1): the loss's label smoothing
        (``SoftmaxCrossEntropy``). A worker lost on the way: its images go to the others and the step
        runs again."""
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"label smoothing must be in [0, 1), got {smoothing!r}")
        be = net.backend
        x = np.ascontiguousarray(x if isinstance(x, np.ndarray) else be.to_numpy(x), dtype=np.float32)
        y = np.asarray(y)
        self._spec = self._spec or spec_of(net, self.image_size)
        start = self._start(net)
        while True:
            try:
                loss, logits = self._step(net, x, y, start, smoothing)
                break
            except Lost as e:
                self.lose(e.workers)
        for info in self.transport.joined():
            self._join(info)
        return loss, logits

    def _op(self, what: str, batch: int) -> Op:
        """A new op of the next step, named ``what`` in errors, with the step's deadline."""
        return self.rpc.op(f"{what} {self.step + 1}", self.backend, {"step": self.step + 1}, self.timeout(batch))

    def _finish(self, stats: list[tuple[str, OpStats]], counts: list[int]) -> None:
        """Record the step like a model-parallel one (``stats``: (name, ``op.stats(self.seats)`` taken
        as the op's last result came in) in the order the ops ran): conv_s the slowest participant's
        compute summed over the ops, comm_s the rest of their wall time; let the rebalancer judge the
        split by each participant's ready time."""
        names = self.participants

        def each(field: str, only: list[OpStats] | None = None) -> list:
            return [sum(s.of(name, field) for s in (only or [s for _, s in stats])) for name in names]

        self.step += 1
        compute, sent, recv = each("compute_s"), each("sent"), each("recv")
        record = {
            "parallel": self.parallel,
            "comm_s": sum(s.comm_s for _, s in stats),
            "conv_s": sum(s.conv_s for _, s in stats),
            "bytes_sent": sum(sent),
            "bytes_recv": sum(recv),
            "participant_bytes_sent": sent,
            "participant_bytes_recv": recv,
            "shares": {UNIT: list(counts)},
            "channel_shares": {},
            "participants": names,
            "participant_conv_s": compute,
            "ops": [
                {"layer": UNIT, "op": op, "wall_s": s.wall_s, "compute_s": each("compute_s", [s])} for op, s in stats
            ],
            "rebalanced": {},
        }
        moved = [s + r for s, r in zip(sent, recv, strict=True)]
        self._moved = dict(zip(names, moved, strict=True))
        if self.rebalancer is not None:
            links = [0.0 if k is None else self.rpc.link(k).seconds_per_byte() or 0.0 for _, k in self.seats]
            ready = [c + b * s for c, b, s in zip(compute, moved, links, strict=True)]
            proposal = self.rebalancer.observe(UNIT, counts, ready)
            if proposal is not None:
                log.info("rebalancing images: %s -> %s (%s)", counts, proposal, ", ".join(names))
                self.counts[UNIT] = list(proposal)
                record["rebalanced"] = {UNIT: list(proposal)}
        self.last_step = record

    def timeout(self, batch: int) -> float:
        """Seconds a worker has to answer one op: ten times its calibrated time (scaled to ``batch``)
        plus its last step's bytes at its link's rate, at least 10 s, at most ``recv_timeout``; until
        those are known, ``recv_timeout``."""
        known = [self.timings.get(name) for name, _ in self.seats]
        transfer = [self._moved.get(name, 0) * (self.rpc.link(k).seconds_per_byte(exact=False) or 0.0)
                    for name, k in self.seats if k is not None]  # fmt: skip
        if not known or None in known or not self.calibrated_batch or not self._moved:
            return self.recv_timeout
        op_s = max(known) * max(1.0, batch / self.calibrated_batch) + max(transfer, default=0.0)
        return min(self.recv_timeout, max(10.0, 10 * op_s))

    # ---- membership -------------------------------------------------------------------------
    def _join(self, info: WorkerInfo) -> None:
        """A worker that joined late: timed on its slice's work for the batch, then given images."""
        name = f"worker{info.index}"
        self.rpc.workers[info.index] = info
        if self._spec is not None and self.calibrated_batch:
            try:
                known = min(self.timings.values(), default=None)
                self.timings[name] = self._time_worker(info.index, self._spec, self.calibrated_batch, known)
            except (Lost, RuntimeError) as e:
                log.warning("%s joined but could not be timed (%s); it is left out", name, e)
                return
        self.workers.append(info)
        self.seats.append((name, info.index))
        self._replan()
        self.events.append({"event": "worker_joined", "step": self.step, "worker": name, "backend": info.backend,
                            "device": info.device.get("device", "?"), "host": info.hostname,
                            "shares": {UNIT: list(self.counts[UNIT])}})  # fmt: skip

    def _replan(self) -> None:
        """The batch split among the participants now by eq. 1 on their calibrated times (equally where
        one is missing), and a rebalancer that starts afresh from those times."""
        batch = self.calibrated_batch or sum(self.counts.get(UNIT, [])) or len(self.seats)
        times = [self.timings.get(name) for name, _ in self.seats]
        weights = speed_weights(times) if None not in times else [1.0] * len(times)
        self.counts[UNIT] = apportion(weights, batch)
        if self.rebalancer is not None:
            self.rebalancer = self.rebalancer.fresh()
            if None not in times:
                self.rebalancer.record(UNIT, [batch] * len(times), times)
