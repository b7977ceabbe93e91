"""What every split of the batch needs, whatever each participant computes on its slice.

Data parallelism (``server.py``) and the hybrid (``hybrid.py``) share each batch by images: one unit,
``"batch"``, whose count per participant is its images. Here, once for both: everyone timed on one
slice's work, the step's :class:`Slices`, a step run again when a worker is lost, and the step's record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.distributed.accounting import OpStats, batch_record
from tinyconv.distributed.calibrate import worker_times
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.replay_check import ReplayCheck
from tinyconv.distributed.replica.replica import build, spec_of
from tinyconv.distributed.rpc import Lost, Op
from tinyconv.distributed.runtime import Runtime
from tinyconv.distributed.shard.balance import apportion, slices
from tinyconv.model import Network
from transports.base import Message, Transport, WorkerInfo

log = logging.getLogger(__name__)

UNIT = "batch"  # the name the image shares go by in plans, metrics and the rebalancer


@dataclass
class Slices:
    """One step's images: ``counts`` per participant (plan order), their ``spans`` (start, end) of
    the batch, ``share`` worker index (None: the master) -> images, ``order`` the indices with images
    in participant order, ``mine`` the master's span if it has images."""

    batch: int
    counts: list[int]
    spans: list[tuple[int, int]]
    share: dict[int | None, int]
    order: list[int | None]
    mine: tuple[int, int] | None

    @classmethod
    def of(cls, placement: list[tuple[str, int | None]], counts: list[int]) -> Slices:
        spans = slices(counts)
        share = {k: c for (_, k), c in zip(placement, counts, strict=True)}
        mine = next((spans[i] for i, (_, k) in enumerate(placement) if k is None and counts[i] > 0), None)
        return cls(sum(counts), counts, spans, share, [k for k, c in share.items() if c > 0], mine)

    def workers(self) -> list[tuple[int, int, int]]:
        """(worker index, start, end) of each worker with images."""
        return [(k, s, e) for k, (s, e) in zip(self.share, self.spans, strict=True) if k is not None and e > s]

    def sum_into(self, net: Network, grads: dict, stats: dict, buffers: np.ndarray) -> None:
        """Every participant's gradient summed in participant order (the same sum on every run) into
        ``net``'s grads; with batch norm, the running statistics ``buffers`` of the step's start updated by
        the slices' batch ``stats``, weighted by images: r <- (1 - m) r + m sum_i (n_i / N) stat_i."""
        total = grads[self.order[0]].copy()
        for k in self.order[1:]:
            total += grads[k]
        flat.unpack(net, total, "grads")
        if buffers.size:
            weighted = sum(stats[k] * np.float32(self.share[k] / self.batch) for k in self.order)
            m = np.concatenate([np.full(a.size, layer.momentum, np.float32) for layer in net.layers
                                for a in layer.buffers.values()])  # fmt: skip
            flat.unpack(net, ((1 - m) * buffers + m * weighted).astype(np.float32), "buffers")


class BatchSplit(Runtime):
    """The master (on ``backend``) and ``workers`` (on ``transport``) sharing each batch by images;
    ``options``: :class:`~tinyconv.distributed.runtime.Runtime`'s; its spot check replays a worker's whole tasks.

    A subclass writes ``_start(net)``, what every attempt at a step starts from (packed once, before the first),
    and ``_step(net, x, y, start, smoothing)``, one attempt: it fills the grads for the loss label-smoothed by
    ``smoothing``, calls ``_finish`` and returns (mean loss, logits on the master's backend), or raises Lost when
    a worker could not be counted on."""

    splits = "images"  # what a checkpoint's plan counts (the model-parallel Cluster's: kernels)
    checker = ReplayCheck
    calibrate_task = "?"  # the task a worker times its slice's work with
    time_slice: Callable[[Network, dict[str, Any], int, int], float]  # (net, spec, batch, repeats) -> the master's s

    def __init__(self, transport: Transport, workers: Sequence[WorkerInfo], backend: Backend, **options: Any) -> None:
        super().__init__(transport, workers, backend, **options)
        self.calibrated_batch = 0  # the images everyone was timed on
        self._took: dict[str, float] = {}  # worker -> compute seconds per image, the last steps', for the deadlines
        self._spec: dict[str, Any] | None = None

    # ---- what a subclass computes -------------------------------------------------------------
    def _time_own(self, spec: dict[str, Any], batch: int) -> float:
        """Seconds the master takes for a slice of ``batch`` images, on a copy of the network (its own keeps
        its caches and statistics)."""
        return self.time_slice(build(spec, self.backend, batch), spec, batch, self.calibration_repeats)

    # ---- shares -----------------------------------------------------------------------------
    def _units(self) -> list[str]:
        return [UNIT]

    def _apportion(self, unit: str, weights: list[float]) -> int:
        batch = self.calibrated_batch or sum(self.counts.get(UNIT, [])) or len(self.placement)
        self.counts[UNIT] = apportion(weights, batch)
        return batch

    def _time_all(self, net: Network, batch_size: int) -> dict[str, dict[str, float]]:
        spec = self._spec = spec_of(net, self.image_size)
        times: dict[str, float] = {}
        # the master first: a worker's deadline grows with what its run took (calibrate.SLOWER)
        for name, k in sorted(self.placement, key=lambda place: place[1] is not None):
            reference = min(times.values(), default=None)
            own = k is None
            times[name] = self._time_own(spec, batch_size) if own else self._time_worker(k, spec, batch_size, reference)
        self.calibrated_batch = batch_size
        return {name: {UNIT: t} for name, t in times.items()}

    def _joiner_task(self) -> tuple[Message, int]:
        header = {"net": self._spec, "batch": self.calibrated_batch, "repeats": self.calibration_repeats}
        return Message(self.calibrate_task, header), 1

    def _joiner_timings(self, times: list[float]) -> dict[str, float]:
        return {UNIT: times[0]}

    def _time_worker(self, k: int, spec: dict[str, Any], batch: int, reference: float | None = None) -> float:
        """Worker k's seconds for ``batch`` images; ``reference``: a participant's, already timed."""
        task = Message(self.calibrate_task, {"net": spec, "batch": batch, "repeats": self.calibration_repeats})
        return worker_times(self.rpc, k, task, f"{self.parallel}-parallel calibration", 1, reference)[0]

    def set_plan(self, layer: str, counts: Sequence[int], channels: Sequence[int] | None = None) -> None:
        """Use ``counts`` images per participant (``layer`` must be "batch") from the next step on."""
        if layer != UNIT or channels:
            raise ValueError(f"a {self.parallel}-parallel plan splits the {UNIT!r} by images, not {layer!r} by kernels")
        if len(counts) != len(self.placement) or any(c < 0 for c in counts) or sum(counts) == 0:
            raise ValueError(
                f"a plan needs {len(self.placement)} image counts >= 0 ({', '.join(self.participants)}), "
                f"not all 0; got {list(counts)}"
            )
        self.counts[UNIT] = [int(c) for c in counts]

    def shares(self, batch: int) -> list[int]:
        """Images per participant for a batch of ``batch``: the plan's, scaled by largest remainder
        when the batch is of another size (equal until calibrated)."""
        counts = self.counts.get(UNIT)
        if counts is None or len(counts) != len(self.placement):
            counts = self.counts[UNIT] = apportion([1.0] * len(self.placement), batch)
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
                self.lose(e.workers, e.wrong)
        self._welcome_joiners()
        return loss, logits

    def _op(self, what: str, batch: int) -> Op:
        """A new op of the next step, named ``what`` in errors, with the compute deadlines of what each worker's
        images should take (:meth:`Runtime._expect`: by the last steps, else by the calibration)."""
        units = dict(zip((k for _, k in self.placement), self.shares(batch), strict=True))
        expect = self._expect(UNIT, units, max(1.0, batch / (self.calibrated_batch or batch)), self._took)
        return self.rpc.op(f"{what} {self.step + 1}", self.backend, {"step": self.step + 1}, expect=expect, units=units)

    def _finish(self, stats: list[tuple[str, OpStats]], counts: list[int]) -> None:
        """Record the step like a model-parallel one (``stats``: (name, ``OpStats.from_op(op, self.placement)`` taken
        as the op's last result came in) in the order the ops ran); let the rebalancer judge the
        split by each participant's ready time: its compute plus its bytes at its link's rate."""
        self.step += 1
        record = batch_record(self.parallel, UNIT, stats, self.participants, counts)
        if self.spot is not None and "master" in self.participants and counts[0]:  # its speed, for the budget
            self.spot.master_rate = record["participant_conv_s"][0] / counts[0]
        moved = [s + r for s, r in zip(record["participant_bytes_sent"], record["participant_bytes_recv"], strict=True)]
        for name, n, compute in zip(self.participants, counts, record["participant_conv_s"], strict=True):
            if n and name != "master":  # a high-water mark that halves step by step, as the model split's
                self._took[name] = max(compute / n, self._took.get(name, 0.0) / 2)
        if self.rebalancer is not None:
            links = self._links()
            per_byte = [links[name] for name in self.participants]
            ready = [c + b * s for c, b, s in zip(record["participant_conv_s"], moved, per_byte, strict=True)]
            proposal = self.rebalancer.observe(UNIT, counts, ready)
            if proposal is not None:
                log.info("rebalancing images: %s -> %s (%s)", counts, proposal, ", ".join(self.participants))
                self.counts[UNIT] = list(proposal)
                record["rebalanced"] = {UNIT: list(proposal)}
        self.last_step = record
