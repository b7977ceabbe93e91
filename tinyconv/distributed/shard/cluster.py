"""The cluster: the master and its workers, and how each sharded layer is split among them.

    cluster = Cluster(transport, workers, backend)   # workers: the transport's hellos
    cluster.calibrate(net, batch_size=64)            # attaches, times everyone (calibrate.py), eq. 1
    cluster.train_batch(net, x, y)                   # net.forward, net.backward: each ShardedBlock
                                                     # asks plan() and runs its split
    cluster.last_step                                # the finished step's comm/conv split, bytes, shares

Participants, loss and joins, calibration and deadlines are ``runtime.py``'s; this file adds the
sharded layers, their plans and the step's record, taken with the first layer's backward. The
rebalancer's new split applies from the next step on, never between a forward and its backward.
"""

from __future__ import annotations

import logging
import numbers
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.distributed.accounting import LayerStep, step_record
from tinyconv.distributed.adaptive_precision import formats_of, policy
from tinyconv.distributed.calibrate import time_everyone
from tinyconv.distributed.conv_shapes import conv_shapes
from tinyconv.distributed.runtime import Runtime
from tinyconv.distributed.shard.balance import apportion
from tinyconv.distributed.shard.by_channels import PIPELINE
from tinyconv.distributed.shard.layer import ShardedBlock, tail_of
from tinyconv.distributed.shard.plan import Plan
from tinyconv.distributed.spot_check import SpotCheck
from tinyconv.distributed.wire_codec import Narrowing
from tinyconv.layers import Conv2D, Layer
from tinyconv.model import Network
from tinyconv.parallel import forward_backward
from transports.base import Message, Transport, WorkerInfo

log = logging.getLogger(__name__)

SPLITS = ("auto", "channels", "kernels")


class Cluster(Runtime):
    """The master (on ``backend``) and ``workers`` (on ``transport``), sharing the network's convolutions.

    ``split``: how a layer that needs dX (every conv but the first) is split. "kernels" -- the
    paper's way (``by_kernels.py``); "channels" -- the convolution by input channels and its tail
    by kernels (``by_channels.py``): nothing is computed twice, but partial sums cross the wire;
    "auto" -- "channels" with workers that all run on the master's host (bytes are cheap there;
    docs/results.md), else "kernels", which a LAN carries better.
    ``fuse``: each participant also runs the ReLU / LRN / batch norm / max pool after each conv on its own
    channels (``block.py``); False is the paper's split, the convolution alone.
    ``wire_precision``: the words a layer's arrays travel in, one of ``adaptive_precision.SETTINGS`` (a
    fixed format, or AWP's "adaptive"); every computation stays float32, and the spot check skips narrowed ops.
    ``pipeline``: a layer split by input channels goes in chunks of this many images, so that one
    chunk's partial sums cross while the next computes (``by_channels.py``); 0: the whole batch.
    ``options``: :class:`~tinyconv.distributed.runtime.Runtime`'s (``recv_timeout`` is also the most a
    worker's compute has before it is known: :meth:`expect`).
    """

    parallel = "model"
    splits = "kernels"  # what a checkpoint's plan counts (the batch splits': images)
    checker = SpotCheck

    def __init__(
        self,
        transport: Transport,
        workers: Sequence[WorkerInfo],
        backend: Backend,
        split: str = "auto",
        fuse: bool = True,
        wire_precision: str = "fp32",
        pipeline: int = PIPELINE,
        **options: Any,
    ) -> None:
        super().__init__(transport, workers, backend, **options)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if not (isinstance(pipeline, int) and pipeline >= 0):
            raise ValueError(f"pipeline must be images per chunk, an int >= 0 (0: the whole batch), got {pipeline!r}")
        self.wire = policy(wire_precision)  # raises ValueError naming the settings
        self.wire_precision = wire_precision
        self._roles: dict[str, dict[str, str]] = {}  # layer -> the formats of its arrays this step
        here = socket.gethostname()
        local = all(w.hostname == here for w in self.workers)
        self.split_by_channels = split == "channels" or (split == "auto" and local)
        self.pipeline = pipeline
        self.fuse = fuse
        self.blocks: list[ShardedBlock] = []  # of the attached network, in order
        self._specs: list[dict[str, Any]] | None = None  # the calibrated layers, to time a joiner on
        self._net: Network | None = None
        self._done: list[LayerStep] = []  # this step's layers, as their backwards finish
        self._took: dict[tuple[str, str], dict[str, float]] = {}  # (layer, op) -> worker -> compute s per unit, image
        self.redo = False  # the step just ended was tainted (Runtime.tainted): train_batch runs it again

    # ---- the network ----------------------------------------------------------------------
    def attach(self, net: Network) -> None:
        """Replace each Conv2D of ``net`` -- with ``fuse``, and the ReLU / LRN / batch norm / max pool right after
        it -- by one :class:`ShardedBlock` computed on this cluster. The parameters stay the same arrays."""
        if self._net is net:
            return
        if self._net is not None:
            raise ValueError("this cluster already serves another network: detach it first")
        layers, i = [], 0
        while i < len(net.layers):
            layer, i = net.layers[i], i + 1
            if isinstance(layer, Conv2D):
                tail = net.layers[i : i + len(tail_of(net.layers[i:]))] if self.fuse else []
                by_channels = layer.need_dx and self.split_by_channels  # the first conv needs no dX: by kernels
                layer, i = ShardedBlock(self, len(self.blocks), layer, tail, by_channels), i + len(tail)
                self.blocks.append(layer)
            layers.append(layer)
        if not self.blocks:
            raise ValueError("the network has no Conv2D layer: there is nothing to distribute")
        net.layers = layers
        self._net = net

    def detach(self, net: Network) -> None:
        """Put ``net``'s own layers back: its convolutions are computed on the master alone again."""
        if self._net is not net:
            return
        net.layers = self._unfused(net)
        self.blocks, self._net, self._done = [], None, []

    def _unfused(self, net: Network) -> list[Layer]:
        """``net``'s own layers: each ShardedBlock of this cluster opened into its convolution and tail."""
        return [inner for layer in net.layers for inner in (layer.layers if layer in self.blocks else [layer])]

    def _release(self) -> None:
        if self._net is not None:
            self.detach(self._net)

    def train_batch(
        self, net: Network, x: Array | np.ndarray, y: np.ndarray, smoothing: float = 0.0
    ) -> tuple[float, Array]:
        """:func:`~tinyconv.parallel.forward_backward` of the attached ``net``: its sharded blocks run their
        splits on the way. Returns (the mean loss, the logits). A worker found wrong partway (a spot check,
        a wrong shape, NaN) may have given the step numbers that went on unchecked: the step then runs again
        without it, from the batch-norm statistics it started from."""
        be = self.backend
        undo = {(i, k): be.to_numpy(a).copy() for i, layer in enumerate(net.layers) for k, a in layer.buffers.items()}
        while True:
            self.redo = False
            result = forward_backward(net, x, y, smoothing)
            if not self.redo:
                return result
            for (i, k), a in undo.items():
                net.layers[i].buffers[k] = be.asarray(a)

    def calibrate(self, net: Network, batch_size: int, image_size: int | None = None) -> dict[str, Any]:
        """Attach ``net`` and calibrate as :meth:`Runtime.calibrate
        <tinyconv.distributed.runtime.Runtime.calibrate>` does, each sharded layer's shape timed
        (``calibrate.py``) on ``image_size`` pixels (default: the cluster's); the result also says
        ``"shapes": {"conv1": {"x": [...], "w": [...]}, ...}``."""
        self.attach(net)
        self.image_size = image_size or self.image_size
        result = super().calibrate(net, batch_size)
        result["shapes"] = {b.name: {"x": s["x"], "w": s["w"]} for b, s in zip(self.blocks, self._specs, strict=True)}
        return result

    def _time_all(self, net: Network, batch_size: int) -> dict[str, dict[str, float]]:
        convs = conv_shapes(Network(net.backend, self._unfused(net)), batch_size, self.image_size)
        specs = self._specs = [_spec(block, c.x) for block, c in zip(self.blocks, convs, strict=True)]
        master = self.backend if ("master", None) in self.placement else None
        times = time_everyone(self.rpc, master, specs, self.calibration_repeats, [w.index for w in self.workers])
        return {name: {b.name: times[k][i] for i, b in enumerate(self.blocks)} for name, k in self.placement}

    def _joiner_task(self) -> tuple[Message, int]:
        return Message("calibrate", {"layers": self._specs, "repeats": self.calibration_repeats}), len(self.blocks)

    def _joiner_timings(self, times: list[float]) -> dict[str, float]:
        return {b.name: t for b, t in zip(self.blocks, times, strict=True)}

    # ---- plans ------------------------------------------------------------------------------
    def _units(self) -> list[str]:
        return [block.name for block in self.blocks]

    def _apportion(self, unit: str, weights: list[float]) -> int:
        """Kernels by ``weights`` for layer ``unit``, and its input channels too if it is split by them."""
        block = next(b for b in self.blocks if b.name == unit)
        self.counts[unit] = apportion(weights, block.conv.out_channels)
        self.channel_counts.pop(unit, None)
        if not self._split_by_channels(block):
            return block.conv.out_channels
        self.channel_counts[unit] = apportion(weights, block.conv.in_channels)
        return block.conv.in_channels

    def set_plan(self, layer: str, counts: Sequence[int], channels: Sequence[int] | None = None) -> None:
        """Use ``counts`` kernels per participant (plan order) for ``layer`` from its next forward on;
        ``channels``: input channels per participant, for a layer split by them (> 0 exactly where the
        kernels are). Without it the layer keeps its channel split if that fits, else one proportional."""
        block = next((b for b in self.blocks if b.name == layer), None)
        if block is None:
            attached = ", ".join(b.name for b in self.blocks) or "none"
            raise ValueError(f"no attached layer {layer!r}; attached: {attached}")
        total, n = block.conv.out_channels, len(self.placement)
        if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != total:
            raise ValueError(
                f"a plan for {layer} needs {n} counts >= 0 ({', '.join(self.participants)}) "
                f"summing to its {total} kernels, got {list(counts)}"
            )
        if channels is not None:
            if not _fits(channels, counts, block.conv.in_channels):
                raise ValueError(
                    f"channels for {layer} needs {n} counts >= 0 summing to its {block.conv.in_channels} input "
                    f"channels, 0 exactly where the kernels are 0 ({list(counts)}); got {list(channels)}"
                )
            self.channel_counts[layer] = [int(c) for c in channels]
        self.counts[layer] = [int(c) for c in counts]

    def plan(self, block: ShardedBlock) -> Plan:
        """``block``'s plan for its next forward: an equal split until calibrate or set_plan says otherwise."""
        counts = self.counts.setdefault(block.name, apportion([1.0] * len(self.placement), block.conv.out_channels))
        channels = None
        if self._split_by_channels(block):  # proportional to the kernels at first, and whenever the kept one
            c_in = block.conv.in_channels  # does not fit them
            channels = self.channel_counts.get(block.name)
            if channels is None or not _fits(channels, counts, c_in):
                channels = self.channel_counts[block.name] = apportion([float(k) for k in counts], c_in)
        return Plan.of(self.placement, counts, block.tail, channels)

    def _split_by_channels(self, block: ShardedBlock) -> bool:
        """Whether ``block`` is split by input channels now: it goes so, and has at least one input
        channel and one kernel for every participant."""
        enough = min(block.conv.in_channels, block.conv.out_channels) >= len(self.placement)
        return block.by_channels and enough and any(k is not None for _, k in self.placement)

    def expect(
        self, block: ShardedBlock, batch: int, what: str
    ) -> tuple[dict[int, float], dict[int | None, int] | None]:
        """What ``block``'s ``what`` ("forward" or "backward") on ``batch`` images should take each worker to
        compute (:meth:`Runtime._expect`: by its seconds per unit and image in the last steps, else by the
        calibration), and each participant's units -- kernels, or input channels -- for an uncalibrated op to be
        paced by (``rpc.py``); not for a split by input channels, whose every round is only part of a share."""
        plan = self.plan(block)
        units = dict(zip((k for _, k in self.placement), plan.channel_counts or plan.counts, strict=True))
        rates = {name: rate * batch for name, rate in self._took.get((block.name, what), {}).items()}
        calibrated = self._specs[self.blocks.index(block)]["x"][0] if self._specs is not None else batch
        expect = self._expect(block.name, units, max(1.0, batch / calibrated), rates)
        return expect, None if plan.channel_counts is not None and plan.workers else units

    # ---- steps ------------------------------------------------------------------------------
    def codec(self, block: ShardedBlock) -> Narrowing | None:
        """How ``block``'s ops go on the wire this step (fixed within a step): narrowed, or None for fp32."""
        roles = self._roles.setdefault(block.name, self.wire.roles(block.name))
        return None if self.wire_precision == "fp32" else Narrowing(formats_of(roles))

    def finished(self, block: ShardedBlock, done: LayerStep) -> None:
        """``block``'s backward is done; with the first block's, the step is."""
        self._done.append(done)
        self._measure(done)
        if block is not self.blocks[0]:
            return
        self.gave = set()
        if self.tainted:  # train_batch runs it again: this run counts for nothing
            self._done, self._roles, self.tainted, self.redo = [], {}, False, True
            return
        record = step_record(self._done, self.participants)
        links = self._links()
        record["ready_s"] = {d.name: d.ready_s(links) for d in reversed(self._done)}  # what the rebalancer balances
        record["rebalanced"] = self._rebalance(self._done, record["ready_s"]) if self.rebalancer is not None else {}
        if self.wire_precision != "fp32":  # what each layer's arrays travelled in; AWP then looks at the weights
            record["wire_precision"] = {d.name: self._roles.get(d.name, {}) for d in reversed(self._done)}
        self._done, self._roles = [], {}
        self.step += 1
        if self.wire_precision == "adaptive":
            for b in self.blocks:
                self.wire.observe(self.step, b.name, self.backend.to_numpy(b.conv.params["w"]))
        self.last_step = record
        self._welcome_joiners()

    def _measure(self, done: LayerStep) -> None:
        """Each worker's compute seconds per unit (what the layer is split by) and image in ``done``'s forward
        and backward, which the next steps' deadlines scale."""
        if self.spot is not None and "master" in done.participants:  # its batched speed, for the budget
            i, block = done.participants.index("master"), next(b for b in self.blocks if b.name == done.name)
            conv = block.conv  # its kernels times the input channels it computed them over:
            cells = done.counts[i] * conv.in_channels if done.channels is None else conv.out_channels * done.channels[i]
            if cells and (master_s := done.forward.compute_s[i] + done.backward.compute_s[i]) > 0:
                self.spot.master_rate[block.index] = master_s / (3 * cells * done.images)  # s per kernel-channel-image
        for what, op in (("forward", done.forward), ("backward", done.backward)):
            rates = self._took.setdefault((done.name, what), {})
            for name, n, compute in zip(done.participants, done.units, op.compute_s, strict=True):
                if n and name != "master":  # a high-water mark that halves step by step: a spike widens it
                    rates[name] = max(compute / (n * done.images), rates.get(name, 0.0) / 2)

    def _rebalance(self, done: list[LayerStep], ready: dict[str, list[float]]) -> dict[str, list[int]]:
        """Feed the rebalancer each layer's step, by what the layer is split by -- its kernels, or its input
        channels (whose kernels then follow in proportion) -- and each participant's ready time, ``ready``
        (:meth:`LayerStep.ready_s`); the layers whose kernel counts change, with the new ones."""
        rebalanced = {}
        for d in done:
            if d.participants != self.participants:  # someone was lost during this step: start afresh
                continue
            proposal = self.rebalancer.observe(d.name, d.units, ready[d.name])
            if proposal is None:
                continue
            what = "kernels" if d.channels is None else "input channels"
            log.info("rebalancing %s %s: %s -> %s (%s)", d.name, what, d.units, proposal, ", ".join(self.participants))
            if d.channels is not None:
                self.channel_counts[d.name] = proposal
                proposal = apportion([float(c) for c in proposal], sum(d.counts))
            self.counts[d.name] = proposal
            rebalanced[d.name] = list(proposal)
        return rebalanced


def _spec(block: ShardedBlock, x_shape: tuple[int, ...]) -> dict[str, Any]:
    """The calibrate task's description of a training step of ``block`` on an input of ``x_shape`` (calibrate.py)."""
    c = block.conv
    w = [c.out_channels, c.in_channels, c.kernel, c.kernel]
    conv = {"stride": c.stride, "padding": c.padding, "need_dx": c.need_dx}
    return {"layer": block.index, "x": list(x_shape), "w": w, **conv, "tail": tail_of(block.layers[1:], training=True)}


def _fits(channel_counts: Sequence[int], counts: Sequence[int], channels: int) -> bool:
    """A split of the input channels that works with the kernel split ``counts``: one count >= 0
    per participant, summing to ``channels``, and 0 exactly for the participants without kernels
    (a partial convolution needs someone to sum it, a tail someone's partial)."""
    return (
        len(channel_counts) == len(counts)
        and all(isinstance(c, numbers.Integral) and c >= 0 for c in channel_counts)
        and sum(channel_counts) == channels
        and all((c == 0) == (k == 0) for c, k in zip(channel_counts, counts, strict=True))
    )
