"""The sharded convolution: one Conv2D computed by kernels across the master and its workers.

Splitting a convolution by kernels (output channels) changes who computes a
feature map, not what it is. With the F kernels cut into contiguous slices
[s_i, e_i), one per participant i::

    forward   y[:, s_i:e_i]  = conv(x, w[s_i:e_i], b[s_i:e_i])          every participant gets all of x
    backward  dw[s_i:e_i], db[s_i:e_i] = from dy[:, s_i:e_i]            rows of dw, db: concatenate
              dx = sum_i conv_backward_x(dy[:, s_i:e_i], w[s_i:e_i])    dx = W^T dY splits into a sum

so the master sends every worker the same x and its slice of w and b, computes
its own slice meanwhile (if it takes part), and concatenates the slices along the
channel axis in plan order; backward sends each worker its slice of dy,
concatenates dw and db and sums the partial dx (none for the first layer). The
optimiser then updates all weights on the master, so a new split is simply a
different slicing at the next step.

That is the paper's split (``fuse=False, split="kernels"``). Beyond it, by default:

* ``fuse``: the ReLU / LRN / max pool after each conv (its *tail*) run on each
  participant's own channels too, with a halo of neighbouring kernels for LRN
  (``tinyconv/block.py``); y and dy are then the tail's output and its gradient.
* ``split="channels"`` (auto with at most 2 workers on this host): a layer that needs dX has its
  convolution split by *input* channels instead: participant i computes the partial
  convolution of its channels [c0_i, c1_i), all F kernels; the partials are summed by
  kernels where the tails run, and backward gives dx[:, c0_i:c1_i] and dw[:, c0_i:c1_i]
  (:meth:`ShardedConv._forward_by_channels`, :meth:`ShardedConv._backward_by_channels`).
  Split by kernels, every participant builds the im2col columns of the whole input and
  reads all of them in two GEMMs, and computes a full-size partial dX: split by channels,
  nothing is done twice.

Participants, in this order everywhere (plans, ``shares``, times): the master
first if it takes part, then the workers by index. Names: "master", "worker0", ...

How many kernels each gets (``tinyconv/balance.py``): :meth:`ShardedConv.calibrate`
times a forward + backward of each layer's exact shape on every participant and
splits by the paper's eq. 1; with ``rebalance`` a :class:`~tinyconv.balance.Rebalancer`
then adjusts the split from the calibration times and each step's measured compute
times, fitting each participant's fixed and per-kernel cost. Before any
calibration every participant gets an equal share.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from backends.base import Array, Backend, conv_output_size
from tinyconv.block import (
    block_backward,
    block_forward,
    extended,
    grad_span,
    owned,
    tail_backward,
    tail_forward,
    tail_of,
    tail_output_hw,
)
from tinyconv.layers import Conv2D, Linear, MaxPool2D
from tinyconv.model import Network
from tinyconv.shard.balance import kernel_counts, slices, speed_weights
from tinyconv.shard.rebalance import Rebalancer
from transports.base import Message, Transport, WorkerInfo

log = logging.getLogger(__name__)

MASTER = -1  # the master's place in a participant list; workers are their transport indices
MASTER_SHARES = ("auto", "0")
SPLITS = ("auto", "channels", "kernels")


def conv_input_shapes(net: Network, batch_size: int, image_size: int = 32) -> list[tuple[int, int, int, int]]:
    """The input shape (N, C, H, W) each Conv2D of ``net`` sees, in order, for square images.

    Walks the layers: a Conv2D or MaxPool2D changes (H, W) by (size + 2 pad - k) // stride + 1,
    a Conv2D also the channels; every other layer keeps the shape until the first Linear.
    The input has the first convolution's in_channels.
    """
    convs = net.conv_layers()
    if not convs:
        raise ValueError("the network has no Conv2D layer: there is nothing to distribute")
    n, c, h, w = batch_size, convs[0].in_channels, image_size, image_size
    shapes = []
    for layer in net.layers:
        if isinstance(layer, Conv2D):
            shapes.append((n, c, h, w))
            h = conv_output_size(h, layer.kernel, layer.stride, layer.padding)
            w = conv_output_size(w, layer.kernel, layer.stride, layer.padding)
            c = layer.out_channels
        elif isinstance(layer, MaxPool2D):
            h = conv_output_size(h, layer.kernel, layer.stride, layer.padding)
            w = conv_output_size(w, layer.kernel, layer.stride, layer.padding)
        elif isinstance(layer, Linear):
            break
        if h <= 0 or w <= 0:
            raise ValueError(f"{image_size}x{image_size} images shrink to nothing at {layer!r}")
    return shapes


def _fits_kernels(channel_counts: list[int], counts: list[int], channels: int) -> bool:
    """A split of the input channels that works with the kernel split ``counts``: one count >= 0
    per participant, summing to ``channels``, and 0 exactly for the participants without kernels
    (a partial convolution needs someone to sum it, a tail someone's partial)."""
    return (
        len(channel_counts) == len(counts)
        and all(isinstance(c, (int, np.integer)) and c >= 0 for c in channel_counts)
        and sum(channel_counts) == channels
        and all((c == 0) == (k == 0) for c, k in zip(channel_counts, counts, strict=True))
    )


@dataclass
class _OpStats:
    """One distributed forward or backward of one layer."""

    wall_s: float  # from the start of the op to its assembled result, on the master
    compute_s: list[float]  # per participant (0 for those without kernels)
    sent: list[int]  # array bytes to each participant (0 for the master)
    recv: list[int]  # and from it

    @property
    def conv_s(self) -> float:
        """The slowest participant's compute: the part of the op the paper calls conv."""
        return max(self.compute_s)

    @property
    def comm_s(self) -> float:
        """Everything else the op took: transfers, waiting, slicing and concatenating."""
        return max(0.0, self.wall_s - self.conv_s)


@dataclass
class _LayerStep:
    """One layer's forward and backward in a training step, for :meth:`ShardedConv.end_step`."""

    name: str
    counts: list[int]  # kernels per participant
    channels: list[int] | None  # input channels per participant, for a layer split by them
    forward: _OpStats
    backward: _OpStats


@dataclass
class _ShardCache:
    """What a sharded forward keeps for its backward."""

    step: int
    counts: list[int]  # the plan this forward used; its backward uses the same
    channels: list[int] | None  # and its input channels, for a layer split by them
    master_cache: Any  # the master's own BlockCache, or None
    x_shape: tuple[int, ...]
    forward: _OpStats


def _piece(lo: np.ndarray | None, hi: np.ndarray | None, hi_start: int, a: int, b: int) -> np.ndarray:
    """Kernels [a, b) of a worker's partial convolution from the two parts it gave: lo = [0, lo_end)
    and hi = [hi_start, F). A range that ends within lo is an earlier participant's, else a later one's."""
    if lo is not None and b <= lo.shape[1]:
        return lo[:, a:b]
    return hi[:, a - hi_start : b - hi_start]


def _combined(parts: list[_OpStats]) -> _OpStats:
    """One op run in parts (each timed from the op's start): the last part's wall time, the sums of the rest."""
    return _OpStats(
        wall_s=parts[-1].wall_s,
        compute_s=[sum(p.compute_s[i] for p in parts) for i in range(len(parts[0].compute_s))],
        sent=[sum(p.sent[i] for p in parts) for i in range(len(parts[0].sent))],
        recv=[sum(p.recv[i] for p in parts) for i in range(len(parts[0].recv))],
    )


class ShardedConv:
    """Computes Conv2D layers by kernel slices across the master and ``workers``.

    Set as every Conv2D's ``distributor`` by :meth:`attach`; then
    ``Conv2D.forward`` calls :meth:`forward` and ``Conv2D.backward`` :meth:`backward`.
    The trainer calls :meth:`end_step` after each step for the step's accounting.

    ``master_share``: "auto" -- the master computes a slice too, sized by its
    calibrated speed like any worker; "0" -- the master only coordinates.
    ``rebalance``: adjust the split from measured compute times (see
    :class:`~tinyconv.balance.Rebalancer`; pass ``rebalancer`` to tune it).
    ``recv_timeout``: seconds every worker has to answer one conv op or calibration.
    ``fuse``: each participant also runs the ReLU / LRN / max pool after each conv on
    its own channels (see :meth:`attach`); False is the paper's split, conv only.
    ``split``: how a layer that needs dX (every conv but the first) is split. "kernels" -- the
    paper's way: each participant its kernels, on all of the input, and a full-size partial dX
    summed on the master (every participant pays a whole im2col and col2im). "channels" -- the
    convolution's GEMMs by the layer's *input* channels and only its tail by kernels
    (:meth:`_forward_by_channels`, :meth:`_backward_by_channels`): nothing is computed twice, but
    the partial sums and the conv-output gradient cross the wire (about 2.3x the bytes of "kernels"
    for ``300:1000``'s conv2 with one worker). "auto" -- "channels" with at most 2 workers that all
    run on the master's host (bytes are cheap there), else "kernels", which a LAN carries better.
    The first layer (3 input channels, no dX) always goes by kernels.
    """

    def __init__(
        self,
        transport: Transport,
        workers: list[WorkerInfo],
        backend: Backend,
        master_share: str = "auto",
        rebalance: bool = True,
        recv_timeout: float = 120.0,
        calibration_repeats: int = 3,
        rebalancer: Rebalancer | None = None,
        fuse: bool = True,
        split: str = "auto",
    ) -> None:
        if master_share not in MASTER_SHARES:
            raise ValueError(
                f"master_share must be 'auto' (the master computes kernels too) or '0' (it only "
                f"coordinates), got {master_share!r}"
            )
        if not workers and master_share == "0":
            raise ValueError("no workers and master_share '0': nobody would compute the convolutions")
        if not recv_timeout > 0:
            raise ValueError(f"recv_timeout must be > 0 seconds, got {recv_timeout!r}")
        if not (isinstance(calibration_repeats, int) and calibration_repeats >= 1):
            raise ValueError(f"calibration_repeats must be an int >= 1, got {calibration_repeats!r}")
        self.transport = transport
        self.backend = backend
        self.workers = {w.index: w for w in workers}
        self.master_share = master_share
        self.recv_timeout = float(recv_timeout)
        self.calibration_repeats = calibration_repeats
        self.rebalancer = (rebalancer or Rebalancer()) if rebalance else None
        self.fuse = fuse
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        # "auto": the partial sums and the gathered conv-output gradient cost every worker about
        # its share of the layer's output in bytes, each way: cheap on one host, not over a LAN
        here = socket.gethostname()
        local = all(w.hostname == here for w in workers)
        self.by_channels = split == "channels" or (split == "auto" and len(workers) <= 2 and local)
        self._tails: dict[str, list[dict[str, Any]]] = {}  # layer name -> its fused tail (tinyconv/block.py)
        # participants: the master first if it takes part, then workers by index
        self.who: list[int] = ([MASTER] if master_share == "auto" else []) + sorted(self.workers)
        self.plans: dict[str, list[int]] = {}  # layer name -> kernels per participant
        self.channel_plans: dict[str, list[int]] = {}  # layer name -> input channels per participant
        self.calibration: dict[str, Any] | None = None
        self.step = 0  # training steps finished (end_step calls); sent as each task's "step"
        self._layers: dict[int, tuple[int, str, Conv2D]] = {}  # id(layer) -> (index, name, layer)
        self._next_task = 0
        self._early: dict[int, Message] = {}  # task -> a result that came before its gather (see _gather)
        self._done: list[_LayerStep] = []  # this step's forward + backward of each layer

    # ---- set-up -------------------------------------------------------------------
    @property
    def participants(self) -> list[str]:
        """Participant names in plan order: "master" (if it takes part), "worker0", ..."""
        return ["master" if k == MASTER else f"worker{k}" for k in self.who]

    def attach(self, net: Network) -> None:
        """Make this the distributor of every Conv2D of ``net``; they are named conv1, conv2, ...

        With ``fuse``, the ReLU / LRN / max pool layers right after each conv become its
        *tail*: they are marked ``fused``, so the network skips them, and each participant
        runs them on its own channels (``tinyconv/block.py``).
        """
        i = 0
        for pos, conv in enumerate(net.layers):
            if not isinstance(conv, Conv2D):
                continue
            name = f"conv{i + 1}"
            conv.distributor = self
            self._layers[id(conv)] = (i, name, conv)
            i += 1
            tail = tail_of(net.layers[pos + 1 :]) if self.fuse else []
            self._tails[name] = tail
            for layer in net.layers[pos + 1 : pos + 1 + len(tail)]:
                layer.fused = True

    def detach(self, net: Network) -> None:
        """Compute ``net``'s convolutions (and their tails) on the master's backend alone again."""
        for pos, conv in enumerate(net.layers):
            entry = self._layers.get(id(conv))
            if not isinstance(conv, Conv2D) or entry is None:
                continue
            for layer in net.layers[pos + 1 : pos + 1 + len(self._tails.pop(entry[1], []))]:
                layer.fused = False
            del self._layers[id(conv)]
            conv.distributor = None

    def set_plan(self, layer: str, counts: list[int], channels: list[int] | None = None) -> None:
        """Use ``counts`` kernels per participant (plan order) for ``layer`` from the next forward on.

        ``channels``: input channels per participant, for a layer split by them (> 0 exactly
        where the kernels are). Without it the layer keeps its channel split, or, if that does
        not fit ``counts``, gets one proportional to them.
        """
        convs = {name: conv for _, name, conv in self._layers.values()}
        if layer not in convs:
            raise ValueError(f"no attached layer {layer!r}; attached: {', '.join(sorted(convs)) or 'none'}")
        total = convs[layer].out_channels
        if len(counts) != len(self.who) or any(c < 0 for c in counts) or sum(counts) != total:
            raise ValueError(
                f"a plan for {layer} needs {len(self.who)} counts >= 0 ({', '.join(self.participants)}) "
                f"summing to its {total} kernels, got {counts}"
            )
        if channels is not None:
            if not _fits_kernels(channels, counts, convs[layer].in_channels):
                raise ValueError(
                    f"channels for {layer} needs {len(self.who)} counts >= 0 summing to its "
                    f"{convs[layer].in_channels} input channels, 0 exactly where the kernels are 0 ({counts}); "
                    f"got {channels}"
                )
            self.channel_plans[layer] = [int(c) for c in channels]
        self.plans[layer] = [int(c) for c in counts]

    def calibrate(self, net: Network, batch_size: int, image_size: int = 32) -> dict[str, Any]:
        """Benchmark every participant on each conv layer's exact shape; set the initial plan.

        Each worker, then the master (if it takes part), times a forward + backward of
        every layer on random values of its shape for ``batch_size`` images of
        ``image_size`` x ``image_size`` (median of ``calibration_repeats`` after a
        warm-up: the master runs the very code the workers run). One participant at
        a time, so devices sharing a host do not slow each other's benchmark.
        Each layer's plan is then eq. 1 on those times, apportioned by largest
        remainder (and, for a layer split by input channels, its channels alike). The times
        also go to the rebalancer, if any, as each participant's time for all F kernels (all
        C channels) of the layer: with the first step's, at the calibrated split, it has two
        counts per participant to fit its fixed and per-unit cost
        (:class:`~tinyconv.balance.Rebalancer`).
        Attaches to ``net`` (see :meth:`attach`) if it was not already.
        Returns (and keeps in ``self.calibration``)::

            {"participants": [...], "times": {"conv1": [s, ...], ...},
             "shares": {"conv1": [kernels, ...], ...}, "channel_shares": {"conv2": [channels, ...]},
             "shapes": {"conv1": {"x": [...], "w": [...]}, ...}}
        """
        from tinyconv.worker import ConvWorker  # the master benchmarks itself exactly as a worker does

        self.attach(net)
        convs = net.conv_layers()
        specs = []
        for i, (conv, x_shape) in enumerate(zip(convs, conv_input_shapes(net, batch_size, image_size), strict=True)):
            w_shape = [conv.out_channels, conv.in_channels, conv.kernel, conv.kernel]
            specs.append(
                {
                    "layer": i,
                    "x": list(x_shape),
                    "w": w_shape,
                    "stride": conv.stride,
                    "padding": conv.padding,
                    "need_dx": conv.need_dx,
                    "tail": self._tails.get(f"conv{i + 1}", []),
                }
            )
        header = {"layers": specs, "repeats": self.calibration_repeats}

        times: dict[int, list[float]] = {}
        for k in sorted(self.workers):
            msg = Message("calibrate", {"task": 0, **header})
            replies, _, _ = self._scatter_gather("calibrate", "every conv layer", {k: msg}, None)
            times[k] = self._calibration_times(k, replies[k], len(specs))
        if MASTER in self.who:
            reply = ConvWorker(self.backend).handle(Message("calibrate", {"task": 0, **header}))
            if reply.kind == "error":
                raise RuntimeError(f"the master could not benchmark its own backend: {reply.header['message']}")
            times[MASTER] = self._calibration_times(MASTER, reply, len(specs))

        result: dict[str, Any] = {
            "participants": self.participants,
            "times": {},
            "shares": {},
            "channel_shares": {},
            "shapes": {},
        }
        for i, (conv, spec) in enumerate(zip(convs, specs, strict=True)):
            name = f"conv{i + 1}"
            layer_times = [times[k][i] for k in self.who]
            weights = speed_weights(layer_times)
            self.plans[name] = kernel_counts(weights, conv.out_channels)
            # what the rebalancer moves: the input channels of a layer split by them, else its kernels
            unit = conv.out_channels
            if self._by_channels(conv):
                self.channel_plans[name] = kernel_counts(weights, conv.in_channels)
                result["channel_shares"][name] = list(self.channel_plans[name])
                unit = conv.in_channels
            if self.rebalancer is not None:  # each participant measured on the whole layer: its first (k, t)
                self.rebalancer.record(name, [unit] * len(self.who), layer_times)
            result["times"][name] = layer_times
            result["shares"][name] = list(self.plans[name])
            result["shapes"][name] = {"x": spec["x"], "w": spec["w"]}
        self.calibration = result
        return result

    def _calibration_times(self, k: int, reply: Message, n_layers: int) -> list[float]:
        times = reply.header.get("times")
        if not (isinstance(times, list) and len(times) == n_layers and all(t > 0 for t in times)):
            raise RuntimeError(
                f"{self._describe(k)} answered calibrate with times {times!r}, expected {n_layers} "
                "positive seconds (one per conv layer); is it running the same tinyconv version?"
            )
        return [float(t) for t in times]

    # ---- the distributed ops --------------------------------------------------------
    def forward(self, layer: Conv2D, x: Array) -> tuple[Array, _ShardCache]:
        """x (N, C, H, W) -> y (N, F, OH, OW), each participant computing its kernel slice.

        With a fused tail (see :meth:`attach`) y is the tail's output, each participant
        computing its slice's conv and tail with the halo of ``tinyconv/block.py``. A layer
        split by input channels goes through :meth:`_forward_by_channels`.
        """
        index, name = self._lookup(layer)
        be = self.backend
        w, b = layer.params["w"], layer.params["b"]
        total = layer.out_channels
        tail = self._tails.get(name, [])
        counts = self._plan(name, total)
        spans = slices(counts)
        t0 = time.perf_counter()
        master_only = all(s == e for k, (s, e) in zip(self.who, spans, strict=True) if k != MASTER)
        channels = self._channel_plan(name, layer.in_channels, counts) if self._by_channels(layer) else None
        if channels is not None and not master_only:
            y, master_cache, stats = self._forward_by_channels(layer, index, name, x, spans, slices(channels), t0)
            return y, _ShardCache(self.step, counts, channels, master_cache, tuple(x.shape), stats)

        x_host = None
        messages = {}
        for k, (s, e) in zip(self.who, spans, strict=True):
            if k == MASTER or s == e:
                continue
            if x_host is None:  # one host copy, sent to every worker
                x_host = self._host(x)
            cs, ce = extended(s, e, total, tail)
            header = self._task_header(layer, index)
            if tail:
                header.update(tail=tail, own=[s - cs, e - cs])
            arrays = {
                "x": x_host,
                "w": self._host(be.take_kernels(w, cs, ce)),
                "b": self._host(be.take_kernels(b, cs, ce)),
            }
            messages[k] = Message("conv_forward", header, arrays)

        local = None  # the master's own slice, computed while the workers compute theirs
        if (span := self._master_span(spans)) is not None:
            s, e = span
            cs, ce = extended(s, e, total, tail)
            w_m, b_m = be.take_kernels(w, cs, ce), be.take_kernels(b, cs, ce)
            local = partial(block_forward, be, x, w_m, b_m, layer.stride, layer.padding, tail, (s - cs, e - cs))
        replies, mine, master_s = self._scatter_gather("conv_forward", name, messages, local)

        if not messages:  # the master computed every kernel
            y, master_cache = mine
        else:
            n, _, h, wd = x_host.shape
            oh, ow = tail_output_hw(
                conv_output_size(h, layer.kernel, layer.stride, layer.padding),
                conv_output_size(wd, layer.kernel, layer.stride, layer.padding),
                tail,
            )
            parts = []
            for k, (s, e) in zip(self.who, spans, strict=True):
                if s == e:
                    continue
                if k == MASTER:
                    parts.append(be.to_numpy(mine[0]))
                else:
                    parts.append(self._reply_array(k, replies[k], "y", (n, e - s, oh, ow)))
            y = be.asarray(np.concatenate(parts, axis=1))
            master_cache = mine[1] if mine is not None else None
        stats = self._stats(t0, messages, replies, master_s)
        return y, _ShardCache(self.step, counts, channels, master_cache, tuple(x.shape), stats)

    def _forward_by_channels(self, layer, index, name, x, spans, cspans, t0):
        """Forward of a layer split by input channels, in two parts per worker.

        A convolution is a sum over its input channels, so participant i, holding the input
        channels [c0_i, c1_i), computes the *partial* convolution of all F kernels over them::

            P_i = conv(x[:, c0_i:c1_i], W[:, c0_i:c1_i])        (N, F, OH, OW),   y_conv = sum_i P_i + b

        (part "conv": an im2col and GEMMs of its channels only -- nothing is computed twice). Then
        each participant runs the tail of its kernels [s_i, e_i) with the halo, ext_i = [cs_i, ce_i),
        on sum_j P_j[:, ext_i] + b (part "tail"): every worker sends the master the parts of its
        partial that the others' ext need, and the master sends each worker the others' sum on its
        ext as soon as it has them -- with one worker, right after its own partial, so the two
        transfers cross while the master adds. Returns (y, the master's BlockCache or None, stats).
        """
        be = self.backend
        total, tail = layer.out_channels, self._tails.get(name, [])
        x_host, w_host, b_host = self._host(x), self._host(layer.params["w"]), self._host(layer.params["b"])
        on = [i for i, (c0, c1) in enumerate(cspans) if c0 < c1]  # who has channels (and so kernels)
        ext = {i: extended(*spans[i], total, tail) for i in on}
        messages = {}
        for i in on:
            k, (s, e), (c0, c1) = self.who[i], spans[i], cspans[i]
            if k == MASTER:
                continue
            # what the others' ext need of its partial: the kernels up to the end of the earlier
            # participants' ext, and from the start of the later ones'
            give = [max((ext[j][1] for j in on if j < i), default=0)]
            give.append(min((ext[j][0] for j in on if j > i), default=total))
            cs, ce = ext[i]
            header = self._task_header(layer, index, "conv") | {"ext": [cs, ce], "own": [s - cs, e - cs], "give": give}
            if tail:
                header["tail"] = tail
            arrays = {"x": np.ascontiguousarray(x_host[:, c0:c1]), "w": np.ascontiguousarray(w_host[:, c0:c1])}
            messages[k] = Message("conv_forward", header, arrays)
        pending1 = self._send(messages)
        deadline = time.monotonic() + self.recv_timeout

        partials: dict[int, Callable[[int, int], np.ndarray]] = {}  # participant -> its partial on [a, b)
        tails: dict[int, Message] = {}
        pending2: dict[int, int] = {}

        def others(i: int) -> list[np.ndarray]:
            """P_j[:, ext_i] of the other participants j with channels (views)."""
            return [partials[j](*ext[i]) for j in on if j != i]

        def send_ready() -> None:
            """Part "tail" to every worker whose ext the others' partials now cover."""
            for i in on:
                k = self.who[i]
                if k == MASTER or k in tails or not all(j in partials for j in on if j != i):
                    continue
                arrays = {"b": np.ascontiguousarray(b_host[ext[i][0] : ext[i][1]])}
                if terms := others(i):
                    arrays["sum"] = np.array(terms[0])  # a copy, contiguous, to add the others to
                    for term in terms[1:]:
                        arrays["sum"] += term
                header = self._task_header(layer, index, "tail")
                tails[k] = Message("conv_forward", header, arrays)
                pending2.update(self._send({k: tails[k]}))

        master_s, master_cache = 0.0, None
        m = 0 if self.who[0] == MASTER and 0 in on else None
        if m is not None:
            c0, c1 = cspans[m]
            t = time.perf_counter()
            x_m, w_m = be.asarray(x_host[:, c0:c1]), be.asarray(w_host[:, c0:c1])
            p_m, conv_m = be.conv2d_forward(x_m, w_m, be.zeros((total,)), layer.stride, layer.padding)
            p_m = be.to_numpy(p_m)
            partials[m] = lambda a, b: p_m[:, a:b]
            master_s += time.perf_counter() - t
        send_ready()
        replies1 = self._gather("conv_forward", name, pending1, deadline, later=pending2)
        n, _, h, wd = x_host.shape
        oh = conv_output_size(h, layer.kernel, layer.stride, layer.padding)
        ow = conv_output_size(wd, layer.kernel, layer.stride, layer.padding)
        for i in on:
            k = self.who[i]
            if k == MASTER:
                continue
            lo_end, hi_start = messages[k].header["give"]
            lo = self._reply_array(k, replies1[k], "p_lo", (n, lo_end, oh, ow)) if lo_end > 0 else None
            hi = self._reply_array(k, replies1[k], "p_hi", (n, total - hi_start, oh, ow)) if hi_start < total else None
            partials[i] = partial(_piece, lo, hi, hi_start)
        send_ready()

        if m is not None:
            t = time.perf_counter()
            cs, ce = ext[m]
            s_m = p_m[:, cs:ce] + b_host[cs:ce, None, None]
            for term in others(m):
                s_m += term
            s, e = spans[m]
            y_m, master_cache = tail_forward(be, be.asarray(s_m), conv_m, tail, (s - cs, e - cs))
            y_m = be.to_numpy(y_m)
            master_s += time.perf_counter() - t
        replies2 = self._gather("conv_forward", name, pending2, time.monotonic() + self.recv_timeout)
        oh2, ow2 = tail_output_hw(oh, ow, tail)
        parts = []
        for i in on:
            k, (s, e) = self.who[i], spans[i]
            parts.append(y_m if k == MASTER else self._reply_array(k, replies2[k], "y", (n, e - s, oh2, ow2)))
        y = be.asarray(np.concatenate(parts, axis=1))
        stats = _combined([self._stats(t0, messages, replies1, master_s), self._stats(t0, tails, replies2, 0.0)])
        return y, master_cache, stats

    def backward(self, layer: Conv2D, dy: Array, cache: _ShardCache) -> tuple[Array | None, Array, Array]:
        """dy (N, F, OH, OW) -> (dx (N, C, H, W) or None if not layer.need_dx, dw (F, C, K, K), db (F,)).

        With a fused tail dy is the gradient of the tail's output; each participant gets
        the channels its slice's tail backward reads (``tinyconv.block.grad_span``).
        """
        index, name = self._lookup(layer)
        be = self.backend
        total = layer.out_channels
        tail = self._tails.get(name, [])
        spans = slices(cache.counts)
        t0 = time.perf_counter()

        master_only = all(s == e for k, (s, e) in zip(self.who, spans, strict=True) if k != MASTER)
        dy_host = None if master_only else be.to_numpy(dy)
        messages = {}

        def grad_part(s: int, e: int) -> tuple[np.ndarray, int]:
            """The dy channels kernels [s, e) need, and where they start among the kernels they computed."""
            gs, ge = grad_span(s, e, total, tail)
            return np.ascontiguousarray(dy_host[:, gs:ge], dtype=np.float32), gs - extended(s, e, total, tail)[0]

        for k, (s, e) in zip(self.who, spans, strict=True):
            if k != MASTER and s < e:
                dy_k, dy_from = grad_part(s, e)
                header = {"task": 0, "step": cache.step, "layer": index}
                if tail:
                    header["dy_from"] = dy_from
                messages[k] = Message("conv_backward", header, {"dy": dy_k})

        dy_m = dy_from_m = None
        if (span := self._master_span(spans)) is not None:
            if master_only:
                dy_m, dy_from_m = dy, 0
            else:
                dy_host_m, dy_from_m = grad_part(*span)
                dy_m = be.asarray(dy_host_m)

        if cache.channels is not None and not master_only:
            dx, dw, db, stats = self._backward_by_channels(
                layer, index, name, cache, spans, slices(cache.channels), messages, dy_m, dy_from_m, t0
            )
            self._done.append(_LayerStep(name, cache.counts, cache.channels, cache.forward, stats))
            return dx, dw, db

        local = None
        if dy_m is not None:
            local = partial(block_backward, be, dy_m, cache.master_cache, dy_from_m, layer.need_dx)
        replies, mine, master_s = self._scatter_gather("conv_backward", name, messages, local)
        stats = self._stats(t0, messages, replies, master_s)
        self._done.append(_LayerStep(name, cache.counts, cache.channels, cache.forward, stats))
        if master_only:
            return mine
        dx = None
        if layer.need_dx:  # the partial dX of every participant, summed
            dx = np.zeros(cache.x_shape, np.float32)
            for k, (s, e) in zip(self.who, spans, strict=True):
                if s < e:
                    dx += be.to_numpy(mine[0]) if k == MASTER else self._reply_array(k, replies[k], "dx", cache.x_shape)
            dx = be.asarray(dx)
        w_shape = (layer.in_channels, layer.kernel, layer.kernel)
        dws, dbs = [], []
        for k, (s, e) in zip(self.who, spans, strict=True):
            if s == e:
                continue
            if k == MASTER:
                dws.append(be.to_numpy(mine[1]))
                dbs.append(be.to_numpy(mine[2]))
            else:
                dws.append(self._reply_array(k, replies[k], "dw", (e - s, *w_shape)))
                dbs.append(self._reply_array(k, replies[k], "db", (e - s,)))
        return dx, be.asarray(np.concatenate(dws, axis=0)), be.asarray(np.concatenate(dbs, axis=0))

    def _backward_by_channels(self, layer, index, name, cache, spans, cspans, messages, dy_m, dy_from_m, t0):
        """Backward of a layer split by input channels, in two parts per worker.

        1. "tail": every participant runs its tail's backward; workers send back their kernels'
           conv-output gradient dyc (N, e - s, OH, OW) at once.
        2. "conv": with all of dY_conv (N, F, OH, OW) -- its own dyc, which it kept, and the others'
           (``dyc_lo``, ``dyc_hi``: the kernels before and after its own) -- each participant runs
           the conv's backward through its partial convolution: dx[:, c0:c1] of its input
           channels, dW[:, c0:c1] and db (the same on everyone: the first participant's is taken).
        A worker's part 2 goes out as soon as the master has the others' dyc: with one worker,
        right after the master's own tail backward, so the gradients cross while the master
        assembles its dY.
        Returns (dx, dw, db, stats).
        """
        be = self.backend
        on = [i for i, (c0, c1) in enumerate(cspans) if c0 < c1]
        for msg in messages.values():
            msg.header["part"] = "tail"
        pending1 = self._send(messages)
        deadline = time.monotonic() + self.recv_timeout
        n, _, h, wd = cache.x_shape
        oh = conv_output_size(h, layer.kernel, layer.stride, layer.padding)
        ow = conv_output_size(wd, layer.kernel, layer.stride, layer.padding)
        dyc: dict[int, np.ndarray] = {}  # participant -> its kernels' conv-output gradient (N, e - s, OH, OW)
        convs: dict[int, Message] = {}
        pending2: dict[int, int] = {}

        def send_ready() -> None:
            """Part "conv" to every worker whose missing dyc the master now has."""
            for i in on:
                k = self.who[i]
                if k == MASTER or k in convs or not all(j in dyc for j in on if j != i):
                    continue
                arrays = {}
                for key, around in (("dyc_lo", [j for j in on if j < i]), ("dyc_hi", [j for j in on if j > i])):
                    if around:  # the kernels before this worker's, and after (one: no copy)
                        parts = [dyc[j] for j in around]
                        arrays[key] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
                header = {"task": 0, "step": cache.step, "layer": index, "part": "conv"}
                convs[k] = Message("conv_backward", header, arrays)
                pending2.update(self._send({k: convs[k]}))

        master_s, mine = 0.0, None
        m = 0 if self.who[0] == MASTER and 0 in on else None
        if m is not None:
            t = time.perf_counter()
            d_m = tail_backward(be, dy_m, cache.master_cache, dy_from_m)
            dyc[m] = np.ascontiguousarray(owned(be, d_m, cache.master_cache))
            master_s += time.perf_counter() - t
        send_ready()
        replies1 = self._gather("conv_backward", name, pending1, deadline, later=pending2)
        for i in on:
            k, (s, e) = self.who[i], spans[i]
            if k != MASTER:
                dyc[i] = self._reply_array(k, replies1[k], "dyc", (n, e - s, oh, ow))
        send_ready()
        if m is not None:
            t = time.perf_counter()
            whole = be.asarray(np.concatenate([dyc[i] for i in on], axis=1))
            dx_m, dw_m, db_m = be.conv2d_backward(whole, cache.master_cache.conv, layer.need_dx)
            mine = (be.to_numpy(dx_m) if layer.need_dx else None, be.to_numpy(dw_m), be.to_numpy(db_m))
            master_s += time.perf_counter() - t
        replies2 = self._gather("conv_backward", name, pending2, time.monotonic() + self.recv_timeout)

        dxs, dws, db = [], [], None
        k_shape = (layer.kernel, layer.kernel)
        for i in on:
            k, (c0, c1) = self.who[i], cspans[i]
            if k == MASTER:
                dx_i, dw_i, db_i = mine
            else:
                dx_i = self._reply_array(k, replies2[k], "dx", (n, c1 - c0, h, wd)) if layer.need_dx else None
                dw_i = self._reply_array(k, replies2[k], "dw", (layer.out_channels, c1 - c0, *k_shape))
                db_i = self._reply_array(k, replies2[k], "db", (layer.out_channels,))
            dxs.append(dx_i)
            dws.append(dw_i)
            db = db_i if db is None else db
        dx = be.asarray(np.concatenate(dxs, axis=1)) if layer.need_dx else None
        stats = _combined([self._stats(t0, messages, replies1, master_s), self._stats(t0, convs, replies2, 0.0)])
        return dx, be.asarray(np.concatenate(dws, axis=1)), be.asarray(db), stats

    # ---- per-step accounting -----------------------------------------------------------
    def end_step(self) -> dict[str, Any]:
        """The finished step's accounting; feeds the rebalancer; a new plan applies from the next step.

        Counted: every conv forward that was followed by its backward since the last
        call (a forward without backward, as in evaluation, is not part of a step).
        For each op (one forward or one backward of one layer): conv = the slowest
        participant's compute seconds (workers' reported compute_s, the master's own
        measured time), comm = the op's wall time on the master minus that (transfers,
        waiting, slicing and concatenating), at least 0. Returns::

            {"comm_s": float, "conv_s": float,            # summed over the step's ops
             "bytes_sent": int, "bytes_recv": int,        # array bytes to / from workers
             "participant_bytes_sent": [int, ...], "participant_bytes_recv": [int, ...],  # the same, each
             "shares": {"conv1": [kernels per participant], ...},   # the plan this step used
             "channel_shares": {"conv2": [input channels per participant]},  # layers split by them
             "participants": ["master", "worker0", ...],  # the order of every list here
             "participant_conv_s": [s, ...],              # each one's conv compute this step
             "ops": [{"layer": "conv1", "op": "forward", "wall_s": s, "compute_s": [s, ...]}, ...],  # each op
             "rebalanced": {"conv2": [new kernels], ...}}  # next step's split where it changes ({} if none)

        What the rebalancer balances: each layer's forward + backward time per participant,
        against what the layer is split by -- its kernels, or, for a layer split by input
        channels, those (its kernels then follow them in proportion: they carry only the tail).

        Bytes are the arrays of the conv_forward / conv_backward tasks and of their
        results (``Message.nbytes``), counted the same for every transport: the
        in-process transport moves no bytes over a wire but they are counted anyway,
        as what a network would carry. Message headers, framing, heartbeats and
        calibration are not included (``transport.traffic()`` has the zmq totals).
        """
        ops = [op for done in self._done for op in (done.forward, done.backward)]
        per_participant = [sum(op.compute_s[i] for op in ops) for i in range(len(self.who))]
        shares = {name: list(self.plans[name]) for name in self._layer_names() if name in self.plans}
        channel_shares = {}
        for done in self._done:
            shares[done.name] = list(done.counts)
            if done.channels is not None:
                channel_shares[done.name] = list(done.channels)
        # the ops as they ran: the forwards, then the backwards (which finish the layers in reverse)
        ran = [(d.name, "forward", d.forward) for d in reversed(self._done)]
        ran += [(d.name, "backward", d.backward) for d in self._done]

        rebalanced = {}
        for done in self._done if self.rebalancer is not None else []:
            units = done.counts if done.channels is None else done.channels
            times = [f + b for f, b in zip(done.forward.compute_s, done.backward.compute_s, strict=True)]
            proposal = self.rebalancer.observe(done.name, units, times)
            if proposal is None:
                continue
            what = "kernels" if done.channels is None else "input channels"
            log.info("rebalancing %s %s: %s -> %s (%s)", done.name, what, units, proposal, ", ".join(self.participants))
            if done.channels is not None:
                self.channel_plans[done.name] = proposal
                proposal = kernel_counts([float(c) for c in proposal], sum(done.counts))
            self.plans[done.name] = proposal
            rebalanced[done.name] = list(proposal)

        record = {
            "comm_s": sum(op.comm_s for op in ops),
            "conv_s": sum(op.conv_s for op in ops),
            "bytes_sent": sum(sum(op.sent) for op in ops),
            "bytes_recv": sum(sum(op.recv) for op in ops),
            "participant_bytes_sent": [sum(op.sent[i] for op in ops) for i in range(len(self.who))],
            "participant_bytes_recv": [sum(op.recv[i] for op in ops) for i in range(len(self.who))],
            "shares": shares,
            "channel_shares": channel_shares,
            "participants": self.participants,
            "participant_conv_s": per_participant,
            "ops": [
                {"layer": name, "op": op, "wall_s": stats.wall_s, "compute_s": list(stats.compute_s)}
                for name, op, stats in ran
            ],
            "rebalanced": rebalanced,
        }
        self._done = []
        self.step += 1
        return record

    # ---- helpers ------------------------------------------------------------------------
    def _lookup(self, layer: Conv2D) -> tuple[int, str]:
        entry = self._layers.get(id(layer))
        if entry is None or entry[2] is not layer:
            raise RuntimeError(f"{layer!r} is not attached to this ShardedConv: call attach(net) first")
        return entry[0], entry[1]

    def _layer_names(self) -> list[str]:
        return [name for _, name, _ in sorted(self._layers.values(), key=lambda v: v[0])]

    def _plan(self, name: str, total: int) -> list[int]:
        """This layer's current plan; an equal split until calibrate or set_plan says otherwise."""
        if name not in self.plans:
            self.plans[name] = kernel_counts([1.0] * len(self.who), total)
        counts = self.plans[name]
        if sum(counts) != total:
            raise RuntimeError(f"the plan for {name} has {sum(counts)} kernels, the layer {total}")
        return counts

    def _by_channels(self, layer: Conv2D) -> bool:
        """Whether ``layer`` is split by input channels (when a worker has some): a layer with fewer
        input channels or kernels than participants cannot give each one of both, so it is not."""
        enough = min(layer.in_channels, layer.out_channels) >= len(self.who)
        return layer.need_dx and self.by_channels and bool(self.workers) and enough

    def _channel_plan(self, name: str, channels: int, counts: list[int]) -> list[int]:
        """This layer's input channels per participant; proportional to ``counts`` at first, and
        again whenever the kept split no longer fits them (see :func:`_fits_kernels`)."""
        plan = self.channel_plans.get(name)
        if plan is None or not _fits_kernels(plan, counts, channels):
            plan = self.channel_plans[name] = kernel_counts([float(k) for k in counts], channels)
        return plan

    def _task_header(self, layer: Conv2D, index: int, part: str | None = None) -> dict[str, Any]:
        """The header of a conv_forward task of ``layer`` (its "task" is set when it is sent)."""
        header = {
            "task": 0,
            "step": self.step,
            "layer": index,
            "stride": layer.stride,
            "padding": layer.padding,
            "need_dx": layer.need_dx,
        }
        return header | ({"part": part} if part else {})

    def _master_span(self, spans: list[tuple[int, int]]) -> tuple[int, int] | None:
        if self.who[0] == MASTER and spans[0][0] < spans[0][1]:
            return spans[0]
        return None

    def _host(self, a: Array) -> np.ndarray:
        """A backend array as a C-contiguous float32 host array (a view when already one)."""
        return np.ascontiguousarray(self.backend.to_numpy(a), dtype=np.float32)

    def _describe(self, k: int) -> str:
        if k == MASTER:
            return "the master"
        info = self.workers[k]
        where = info.hostname or info.address or "?"
        return f"worker {k} ({info.backend} on {info.device.get('device', '?')} at {where})"

    def _scatter_gather(
        self, kind: str, layer: str, messages: dict[int, Message], local: Callable[[], Any] | None
    ) -> tuple[dict[int, Message], Any, float]:
        """Send each worker its message, run ``local`` on the master meanwhile, gather every result.

        Returns (worker -> result, local's return value or None, local's seconds).
        Raises TimeoutError naming the workers that did not answer within
        ``recv_timeout``, RuntimeError with a worker's message when it replies ``error``.
        """
        pending = self._send(messages)
        deadline = time.monotonic() + self.recv_timeout
        result, local_s = None, 0.0
        if local is not None:
            t = time.perf_counter()
            result = local()
            self.backend.synchronize()
            local_s = time.perf_counter() - t
        return self._gather(kind, layer, pending, deadline), result, local_s

    def _send(self, messages: dict[int, Message]) -> dict[int, int]:
        """Give each message a task id and send it to its worker; returns task id -> worker."""
        pending: dict[int, int] = {}
        for k, msg in messages.items():
            self._next_task += 1
            msg.header["task"] = self._next_task
            pending[self._next_task] = k
            self.transport.send(k, msg)
        return pending

    def _gather(
        self, kind: str, layer: str, pending: dict[int, int], deadline: float, later: dict[int, int] | None = None
    ) -> dict[int, Message]:
        """Receive the result of every task in ``pending`` (emptied) by ``deadline`` (time.monotonic).

        ``later``: tasks (task -> worker) whose results a later call gathers; any of them that
        arrive meanwhile are kept for it rather than dropped as stale.
        """
        replies: dict[int, Message] = {}
        for task in [t for t in pending if t in self._early]:
            k = pending.pop(task)
            replies[k] = self._early.pop(task)
        while pending:
            try:
                k, reply = self.transport.recv(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                late = ", ".join(self._describe(w) for w in sorted(pending.values()))
                raise TimeoutError(
                    f"{kind} of {layer}: no result from {late} within {self.recv_timeout:g} s; the worker "
                    "may be overloaded, stuck or gone: check its log, or raise recv_timeout"
                ) from None
            task = reply.header.get("task")
            ours = pending.get(task) == k or (later is not None and later.get(task) == k)
            if reply.kind == "error" and (task is None or ours):
                raise RuntimeError(f"{self._describe(k)} failed {kind} of {layer}: {reply.header['message']}")
            if later is not None and later.get(task) == k and reply.kind == "result":
                self._early[task] = reply
                continue
            if pending.get(task) != k:  # a late answer to an op given up on (after an error)
                log.debug("ignoring a stale %s from worker %d (task %r)", reply.kind, k, task)
                continue
            if reply.kind != "result":
                raise RuntimeError(f"{self._describe(k)} answered {kind} of {layer} with a {reply.kind!r}")
            replies[k] = reply
            del pending[task]
        return replies

    def _reply_array(self, k: int, reply: Message, name: str, shape: tuple[int, ...] | None) -> np.ndarray:
        a = reply.arrays.get(name)
        if a is None or (shape is not None and tuple(a.shape) != shape):
            got = "nothing" if a is None else f"shape {tuple(a.shape)}"
            raise RuntimeError(
                f"{self._describe(k)} returned {got} for {name!r}, expected shape {shape}; "
                "is it running the same tinyconv version?"
            )
        return a

    def _stats(self, t0: float, messages: dict[int, Message], replies: dict[int, Message], master_s: float) -> _OpStats:
        compute = []
        for k in self.who:
            if k == MASTER:
                compute.append(master_s)
            else:  # a worker without kernels this op did not compute
                compute.append(float(replies[k].header["compute_s"]) if k in replies else 0.0)
        return _OpStats(
            wall_s=time.perf_counter() - t0,
            compute_s=compute,
            sent=[messages[k].nbytes() if k in messages else 0 for k in self.who],
            recv=[replies[k].nbytes() if k in replies else 0 for k in self.who],
        )
