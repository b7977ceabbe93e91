"""The parameter server: the master splits each batch among whole replicas and sums their gradients.

    replicas = Replicas(transport, workers, backend)
    replicas.calibrate(net, batch_size=64)            # everyone times a forward + backward; eq. 1
    loss, logits = replicas.train_batch(net, x, y)    # one data-parallel step: net's grads filled
    opt.step()                                        # the master applies the optimiser itself
    replicas.last_step                                # comm/conv split, bytes, image shares

One step, for participants i = 0, 1, ... (the master first if it takes part, then the
workers by index) with n_i images each, sum n_i = N::

    1. the master sends worker i its slice x[s_i:e_i], y[s_i:e_i] and the current weights W
       (and the batch-norm statistics) -- ``replica_step``;
    2. it computes its own slice meanwhile, on its own network;
    3. every participant returns g_i, its slice's part of dL/dW for the mean loss over all N
       images (``replica.py``), and its logits;
    4. the master sums g = g_0 + g_1 + ... in participant order (deterministic) into its
       layers' grads; the optimiser then updates W as after a single-process step.

The weights go out whole with every step, not as updates: a worker that applied the
master's update to its own copy would round differently from the master's SGD and drift;
whole weights keep every replica exactly the master's, make a worker that joins or comes
back need nothing but the next step, and cost what the gradients cost on the way back.
A step moves, to and from each worker i, 4 (2P + n_i (C H W + 1 + classes)) bytes (plus the
batch-norm statistics twice): for 50:500 at batch 64 and one worker with half the images,
2 x 3.8 MB of weights and gradients and 0.4 MB of images. Model parallelism moves feature
maps instead, which grow with the batch; this does not (docs/how-it-works.md compares them).

Batch norm normalises each slice by its own statistics (per-replica batch norm, as
PyTorch's DataParallel without SyncBatchNorm), so with ``--norm batch`` a step is not the
single-process step; each participant updates the running statistics from its slice and the
master keeps their average weighted by n_i / N, which for the running mean is exactly the
whole batch's update. With LRN (or no normalisation) a step equals the single-process step
on the whole batch to float32 round-off.

Images are shared like kernels: eq. 1 on the calibrated times, then the rebalancer, with
images as its units. A worker lost during a step (gone, silent past the timeout, non-finite
numbers) is dropped as in the model-parallel cluster: its images go to the others by eq. 1
on their calibrated times and the step runs again from the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.model import Network
from tinyconv.replica import flat
from tinyconv.replica.replica import build, slice_gradients, spec_of, time_replica
from tinyconv.shard.balance import kernel_counts, slices, speed_weights
from tinyconv.shard.rebalance import Rebalancer
from tinyconv.shard.rpc import Lost, Op, Rpc
from transports.base import Message, Transport, WorkerInfo

log = logging.getLogger(__name__)

UNIT = "batch"  # the name the image shares go by in plans, metrics and the rebalancer


class Replicas:
    """The master (on ``backend``) and ``workers`` (on ``transport``), each with a whole replica.

    ``master_share``: "auto" -- the master computes a slice too, sized by its speed; "0" -- it
    only coordinates (and sums). ``rebalance``: follow the measured times (``rebalancer``);
    ``recv_timeout``: the most seconds a worker has to answer one step or its calibration.
    """

    splits = "images"  # what a checkpoint's plan counts (the model-parallel Cluster's: kernels)

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
            raise ValueError("no workers and master_share '0': nobody would compute the replicas")
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

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- shares -----------------------------------------------------------------------------
    def calibrate(self, net: Network, batch_size: int) -> dict[str, Any]:
        """Time every participant on a forward + backward of ``batch_size`` images, split the batch
        by eq. 1. Returns, and keeps, {"participants", "times": {"batch": [s, ...]}, "shares":
        {"batch": [images, ...]}, "channel_shares": {}} (the model-parallel calibration's keys)."""
        spec = self._spec = spec_of(net, self.image_size)
        times: dict[str, float] = {}
        for name, k in self.seats:
            if k is None:
                own = build(spec, self.backend, batch_size)  # a copy: the master's net keeps its statistics
                times[name] = time_replica(own, spec, batch_size, self.calibration_repeats)
            else:
                times[name] = self._time_worker(k, spec, batch_size)
        self.timings, self.calibrated_batch = times, batch_size
        layer_times = [times[name] for name in self.participants]
        self.counts[UNIT] = kernel_counts(speed_weights(layer_times), batch_size)
        if self.rebalancer is not None:  # each measured on the whole batch: its first (images, seconds)
            self.rebalancer.record(UNIT, [batch_size] * len(self.seats), layer_times)
        self.calibration = {"participants": self.participants, "times": {UNIT: layer_times},
                            "shares": {UNIT: list(self.counts[UNIT])}, "channel_shares": {}}  # fmt: skip
        return self.calibration

    def _time_worker(self, k: int, spec: dict[str, Any], batch: int) -> float:
        op = self.rpc.op("replica calibration", self.backend)
        task = Message("replica_calibrate", {"net": spec, "batch": batch, "repeats": self.calibration_repeats})
        got = op.gather([op.send(k, task)])[k].header["times"]
        if not (isinstance(got, list) and len(got) == 1 and isinstance(got[0], (int, float)) and got[0] > 0):
            raise RuntimeError(f"{self.rpc.describe(k)} answered replica_calibrate with {got!r:.100}, "
                               "expected [seconds > 0]; is it running the same tinyconv version?")  # fmt: skip
        return float(got[0])

    def set_plan(self, layer: str, counts: Sequence[int], channels: Sequence[int] | None = None) -> None:
        """Use ``counts`` images per participant (``layer`` must be "batch") from the next step on."""
        if layer != UNIT or channels:
            raise ValueError(f"a data-parallel plan splits the {UNIT!r} by images, not {layer!r} by kernels")
        if len(counts) != len(self.seats) or any(c < 0 for c in counts) or sum(counts) == 0:
            raise ValueError(f"a plan needs {len(self.seats)} image counts >= 0 ({', '.join(self.participants)}), "
                             f"not all 0; got {list(counts)}")  # fmt: skip
        self.counts[UNIT] = [int(c) for c in counts]

    def shares(self, batch: int) -> list[int]:
        """Images per participant for a batch of ``batch``: the plan's, scaled by largest remainder
        when the batch is of another size (equal until calibrated)."""
        counts = self.counts.get(UNIT)
        if counts is None or len(counts) != len(self.seats):
            counts = self.counts[UNIT] = kernel_counts([1.0] * len(self.seats), batch)
        if sum(counts) != batch:
            return kernel_counts([float(c) for c in counts], batch)
        return list(counts)

    # ---- one step ---------------------------------------------------------------------------
    def train_batch(self, net: Network, x: Array | np.ndarray, y: np.ndarray) -> tuple[float, Array]:
        """One data-parallel forward + backward of ``net`` on the batch x (N, C, H, W), y (N,): every
        parameter's grad is the whole batch's, as after ``net.train_step``; returns (the batch's mean
        loss, its logits on the master's backend). A worker lost on the way: its images go to the
        others and the step runs again."""
        be = net.backend
        x = np.ascontiguousarray(x if isinstance(x, np.ndarray) else be.to_numpy(x), dtype=np.float32)
        y = np.asarray(y)
        self._spec = self._spec or spec_of(net, self.image_size)
        params, buffers = flat.pack(net), flat.pack(net, "buffers")
        while True:
            try:
                logits = self._step(net, x, y, params, buffers)
                break
            except Lost as e:
                self.lose(e.workers)
        logits_be = be.asarray(logits)
        loss, _ = net.loss_fn(logits_be, y)
        for info in self.transport.joined():
            self._join(info)
        return loss, logits_be

    def _step(self, net: Network, x: np.ndarray, y: np.ndarray, params: np.ndarray, buffers: np.ndarray) -> np.ndarray:
        batch = len(x)
        counts = self.shares(batch)
        spans = slices(counts)
        share = {k: c for (_, k), c in zip(self.seats, counts, strict=True)}  # worker index (None: master) -> images
        op = self.rpc.op(f"data-parallel step {self.step + 1}", self.backend, {"step": self.step + 1},
                         self.timeout(batch))  # fmt: skip
        extra = {"buffers": buffers} if buffers.size else {}
        tasks = {}
        for (_, k), (s, e) in zip(self.seats, spans, strict=True):
            if k is not None and e > s:
                msg = Message("replica_step", {"net": self._spec, "batch": batch},
                              {"x": x[s:e], "y": y[s:e], "params": params, **extra})  # fmt: skip
                tasks[k] = op.send(k, msg)
        grads, logits, stats = {}, {}, {}
        master = next((i for i, (_, k) in enumerate(self.seats) if k is None), None)
        if master is not None and counts[master] > 0:
            s, e = spans[master]
            with op.local():
                flat.unpack(net, buffers, "buffers")  # the step's start, again if it is a re-run
                logits[None] = slice_gradients(net, x[s:e], y[s:e], batch)
                grads[None], stats[None] = flat.pack(net, "grads"), flat.pack(net, "buffers")
        for k, reply in op.gather(tasks.values()).items():
            grads[k] = op.array(k, reply, "grads", params.shape)
            logits[k] = op.array(k, reply, "logits", (share[k], logits_width(net)))
            stats[k] = op.array(k, reply, "buffers", buffers.shape) if buffers.size else buffers
        order = [k for k, c in share.items() if c > 0]  # participant order
        total = grads[order[0]].copy()
        for k in order[1:]:  # a fixed order: the same sum on every run
            total += grads[k]
        flat.unpack(net, total, "grads")
        if buffers.size:  # each slice's running statistics, weighted by its images
            flat.unpack(net, sum(stats[k] * np.float32(share[k] / batch) for k in order).astype(np.float32), "buffers")
        self._finish(op, counts)
        return np.concatenate([logits[k] for k in order])

    def _finish(self, op: Op, counts: list[int]) -> None:
        """Record the step like a model-parallel one: conv_s the slowest participant's compute, comm_s
        the rest of the step's distributed wall time; let the rebalancer judge the split."""
        stats = op.stats(self.seats)
        self.step += 1
        record = {
            "parallel": "data",
            "comm_s": stats.comm_s,
            "conv_s": stats.conv_s,
            "bytes_sent": sum(stats.sent),
            "bytes_recv": sum(stats.recv),
            "participant_bytes_sent": list(stats.sent),
            "participant_bytes_recv": list(stats.recv),
            "shares": {UNIT: list(counts)},
            "channel_shares": {},
            "participants": self.participants,
            "participant_conv_s": list(stats.compute_s),
            "ops": [{"layer": UNIT, "op": "step", "wall_s": stats.wall_s, "compute_s": list(stats.compute_s)}],
            "rebalanced": {},
        }
        self._moved = {name: stats.moved(name) for name in stats.names}
        if self.rebalancer is not None:
            links = [0.0 if k is None else self.rpc.link(k).seconds_per_byte() or 0.0 for _, k in self.seats]
            moved = [stats.moved(name) for name, _ in self.seats]
            ready = [c + b * s for c, b, s in zip(stats.compute_s, moved, links, strict=True)]
            proposal = self.rebalancer.observe(UNIT, counts, ready)
            if proposal is not None:
                log.info("rebalancing images: %s -> %s (%s)", counts, proposal, ", ".join(self.participants))
                self.counts[UNIT] = list(proposal)
                record["rebalanced"] = {UNIT: list(proposal)}
        self.last_step = record

    def timeout(self, batch: int) -> float:
        """Seconds a worker has to answer one step: ten times its calibrated time (scaled to ``batch``)
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
    def lose(self, workers: dict[int, str]) -> None:
        """``workers`` (index -> why) are no longer participants: their images go to the others."""
        for k, why in workers.items():
            if k in self.lost:
                continue
            self.lost[k] = why
            log.warning("%s lost: %s; its images go to the others", self.rpc.describe(k), why)
            self.seats = [seat for seat in self.seats if seat[1] != k]
            self.workers = [w for w in self.workers if w.index != k]
            if not self.seats:  # the master holds every weight: it can always finish alone
                self.seats = [("master", None)]
            self._replan()
            self.events.append({"event": "worker_lost", "step": self.step, "worker": f"worker{k}", "reason": why,
                                "shares": {UNIT: list(self.counts[UNIT])}})  # fmt: skip

    def _join(self, info: WorkerInfo) -> None:
        """A worker that joined late: timed on a replica of the batch, then given images."""
        name = f"worker{info.index}"
        self.rpc.workers[info.index] = info
        if self._spec is not None and self.calibrated_batch:
            try:
                self.timings[name] = self._time_worker(info.index, self._spec, self.calibrated_batch)
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
        self.counts[UNIT] = kernel_counts(weights, batch)
        if self.rebalancer is not None:
            self.rebalancer = self.rebalancer.fresh()
            if None not in times:
                self.rebalancer.record(UNIT, [batch] * len(times), times)


def logits_width(net: Network) -> int:
    """The number of classes: the width of the network's last parameter, the classifier's bias."""
    return int(net.layers[-1].params["b"].shape[0])
