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

That is the paper's split (``fuse=False, dx="split"``). Beyond it, by default:

* ``fuse``: the ReLU / LRN / max pool after each conv (its *tail*) run on each
  participant's own channels too, with a halo of neighbouring kernels for LRN
  (``tinyconv/block.py``); y and dy are then the tail's output and its gradient.
* ``dx="channels"`` (auto with at most 2 workers): dx is split by *input* channels
  instead of summed from full-size partials: the conv-output gradient is gathered on
  the master, then each participant computes dx[:, c0:c1] for its share of the channels
  (:meth:`ShardedConv._backward_dx_by_channels`).

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from backends.base import Array, Backend, conv_output_size
from tinyconv.balance import Rebalancer, kernel_counts, slices, speed_weights
from tinyconv.block import (
    block_backward,
    block_forward,
    conv_backward,
    extended,
    grad_span,
    owned,
    tail_backward,
    tail_of,
    tail_output_hw,
)
from tinyconv.layers import Conv2D, Linear, MaxPool2D
from tinyconv.model import Network
from transports.base import Message, Transport, WorkerInfo

log = logging.getLogger(__name__)

MASTER = -1  # the master's place in a participant list; workers are their transport indices
MASTER_SHARES = ("auto", "0")
DX_MODES = ("auto", "channels", "split")


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


def _fits_kernels(dx_counts: list[int], counts: list[int], channels: int) -> bool:
    """A channel split of dX that works with the kernel split ``counts``: one count >= 0 per
    participant, summing to ``channels``, and 0 for a participant without kernels."""
    return (
        len(dx_counts) == len(counts)
        and all(isinstance(c, (int, np.integer)) and c >= 0 for c in dx_counts)
        and sum(dx_counts) == channels
        and all(c == 0 for c, k in zip(dx_counts, counts, strict=True) if k == 0)
    )


@dataclass
class _OpStats:
    """One distributed forward or backward of one layer."""

    wall_s: float  # from the start of the op to its assembled result, on the master
    compute_s: list[float]  # per participant (0 for those without kernels)
    bytes_sent: int
    bytes_recv: int

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
    by_channels: bool  # the layer's dX goes by input channels (when a worker has kernels)
    dx_counts: list[int] | None  # input channels of dX per participant, when dX went by channels
    forward: _OpStats
    backward: _OpStats


@dataclass
class _ShardCache:
    """What a sharded forward keeps for its backward."""

    step: int
    counts: list[int]  # the plan this forward used; its backward uses the same
    master_cache: Any  # the master's own backend cache, or None
    x_shape: tuple[int, ...] | None  # the input's shape, when it went to a worker
    forward: _OpStats


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
    ``dx``: how a layer's input gradient is split. "split" -- each participant its
    kernels' full-size partial dX, summed on the master (the paper's way: every participant
    pays a whole col2im). "channels" -- the conv-output gradient is gathered and every
    participant computes dX for a slice of the *input* channels, sized like its kernel
    share (:meth:`_backward_dx_by_channels`): no duplicated work, more bytes on the wire.
    "auto" -- "channels" with at most 2 workers, else "split".
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
        dx: str = "auto",
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
        if dx not in DX_MODES:
            raise ValueError(f"dx must be one of {', '.join(DX_MODES)}, got {dx!r}")
        # "auto": gathering the conv-output gradient costs every worker the whole of it in bytes,
        # which a LAN feels with many workers
        self.dx_by_channels = dx == "channels" or (dx == "auto" and len(workers) <= 2)
        self._tails: dict[str, list[dict[str, Any]]] = {}  # layer name -> its fused tail (tinyconv/block.py)
        # participants: the master first if it takes part, then workers by index
        self.who: list[int] = ([MASTER] if master_share == "auto" else []) + sorted(self.workers)
        self.plans: dict[str, list[int]] = {}  # layer name -> kernels per participant
        self.dx_plans: dict[str, list[int]] = {}  # layer name -> input channels of dX per participant
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

    def set_plan(self, layer: str, counts: list[int], dx_channels: list[int] | None = None) -> None:
        """Use ``counts`` kernels per participant (plan order) for ``layer`` from the next forward on.

        ``dx_channels``: input channels of dX per participant, for a backward with dX split by
        channels (a participant without kernels gets none: it holds no gradient to start from).
        Without it the layer keeps its channel split, or, if that does not fit ``counts``, gets
        one proportional to them.
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
        if dx_channels is not None:
            if not _fits_kernels(dx_channels, counts, convs[layer].in_channels):
                raise ValueError(
                    f"dx_channels for {layer} needs {len(self.who)} counts >= 0 summing to its "
                    f"{convs[layer].in_channels} input channels, 0 wherever the kernels are 0 ({counts}); "
                    f"got {dx_channels}"
                )
            self.dx_plans[layer] = [int(c) for c in dx_channels]
        self.plans[layer] = [int(c) for c in counts]

    def calibrate(self, net: Network, batch_size: int, image_size: int = 32) -> dict[str, Any]:
        """Benchmark every participant on each conv layer's exact shape; set the initial plan.

        Each worker, then the master (if it takes part), times a forward + backward of
        every layer on random values of its shape for ``batch_size`` images of
        ``image_size`` x ``image_size`` (median of ``calibration_repeats`` after a
        warm-up: the master runs the very code the workers run). One participant at
        a time, so devices sharing a host do not slow each other's benchmark.
        Each layer's plan is then eq. 1 on those times, apportioned by largest
        remainder. The times also go to the rebalancer, if any, as each participant's
        time for all F kernels of the layer (the forward's alone where dX goes by input
        channels: see :meth:`end_step`): with the first step's, at the calibrated
        split, it has two kernel counts per participant to fit its fixed and
        per-kernel cost (:class:`~tinyconv.balance.Rebalancer`).
        Attaches to ``net`` (see :meth:`attach`) if it was not already.
        Returns (and keeps in ``self.calibration``)::

            {"participants": [...], "times": {"conv1": [s, ...], ...}, "forward_times": {...},
             "shares": {"conv1": [kernels, ...], ...}, "shapes": {"conv1": {"x": [...], "w": [...]}, ...}}
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
        forward_times: dict[int, list[float]] = {}
        for k in sorted(self.workers):
            msg = Message("calibrate", {"task": 0, **header})
            replies, _, _ = self._scatter_gather("calibrate", "every conv layer", {k: msg}, None)
            times[k] = self._calibration_times(k, replies[k], len(specs))
            forward_times[k] = self._calibration_times(k, replies[k], len(specs), "forward_times")
        if MASTER in self.who:
            reply = ConvWorker(self.backend).handle(Message("calibrate", {"task": 0, **header}))
            if reply.kind == "error":
                raise RuntimeError(f"the master could not benchmark its own backend: {reply.header['message']}")
            times[MASTER] = self._calibration_times(MASTER, reply, len(specs))
            forward_times[MASTER] = self._calibration_times(MASTER, reply, len(specs), "forward_times")

        result: dict[str, Any] = {
            "participants": self.participants,
            "times": {},
            "forward_times": {},
            "shares": {},
            "shapes": {},
        }
        for i, (conv, spec) in enumerate(zip(convs, specs, strict=True)):
            name = f"conv{i + 1}"
            layer_times = [times[k][i] for k in self.who]
            layer_forward_times = [forward_times[k][i] for k in self.who]
            self.plans[name] = kernel_counts(speed_weights(layer_times), conv.out_channels)
            if self.rebalancer is not None:  # each participant measured on all F kernels: its first (k, t)
                # with dX by channels the kernel split is balanced on the forward alone (see end_step)
                measured = layer_forward_times if self._dx_by_channels(conv) else layer_times
                self.rebalancer.record(name, [conv.out_channels] * len(self.who), measured)
            result["times"][name] = layer_times
            result["forward_times"][name] = layer_forward_times
            result["shares"][name] = list(self.plans[name])
            result["shapes"][name] = {"x": spec["x"], "w": spec["w"]}
        self.calibration = result
        return result

    def _calibration_times(self, k: int, reply: Message, n_layers: int, key: str = "times") -> list[float]:
        times = reply.header.get(key)
        if not (isinstance(times, list) and len(times) == n_layers and all(t > 0 for t in times)):
            raise RuntimeError(
                f"{self._describe(k)} answered calibrate with {key} {times!r}, expected {n_layers} "
                "positive seconds (one per conv layer); is it running the same tinyconv version?"
            )
        return [float(t) for t in times]

    # ---- the distributed ops --------------------------------------------------------
    def forward(self, layer: Conv2D, x: Array) -> tuple[Array, _ShardCache]:
        """x (N, C, H, W) -> y (N, F, OH, OW), each participant computing its kernel slice.

        With a fused tail (see :meth:`attach`) y is the tail's output, each participant
        computing its slice's conv and tail with the halo of ``tinyconv/block.py``.
        """
        index, name = self._lookup(layer)
        be = self.backend
        w, b = layer.params["w"], layer.params["b"]
        total = layer.out_channels
        tail = self._tails.get(name, [])
        counts = self._plan(name, total)
        spans = slices(counts)
        t0 = time.perf_counter()

        x_host = None
        messages = {}
        for k, (s, e) in zip(self.who, spans, strict=True):
            if k == MASTER or s == e:
                continue
            if x_host is None:  # one host copy, sent to every worker
                x_host = np.ascontiguousarray(be.to_numpy(x), dtype=np.float32)
            cs, ce = extended(s, e, total, tail)
            header = {
                "task": 0,
                "step": self.step,
                "layer": index,
                "stride": layer.stride,
                "padding": layer.padding,
                "need_dx": layer.need_dx,
            }
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
        x_shape = None if x_host is None else tuple(x_host.shape)
        return y, _ShardCache(self.step, counts, master_cache, x_shape, stats)

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

        if master_only or not self._dx_by_channels(layer):
            local = None
            if dy_m is not None:
                local = partial(block_backward, be, dy_m, cache.master_cache, dy_from_m, layer.need_dx)
            replies, mine, master_s = self._scatter_gather("conv_backward", name, messages, local)
            stats = self._stats(t0, messages, replies, master_s)
            if master_only:
                dx, dw, db = mine
                self._done.append(
                    _LayerStep(name, cache.counts, self._dx_by_channels(layer), None, cache.forward, stats)
                )
                return dx, dw, db
            dx = None
            if layer.need_dx:  # the partial dX of every participant, summed
                dx = np.zeros(cache.x_shape, np.float32)
                for k, (s, e) in zip(self.who, spans, strict=True):
                    if s < e:
                        dx += (
                            be.to_numpy(mine[0])
                            if k == MASTER
                            else self._reply_array(k, replies[k], "dx", cache.x_shape)
                        )
                dx = be.asarray(dx)
            dx_counts = None
        else:
            dx_counts = self._dx_plan(name, layer.in_channels, cache.counts)
            dx, mine, replies, stats = self._backward_dx_by_channels(
                layer, name, cache, spans, slices(dx_counts), messages, dy_m, dy_from_m, t0
            )

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
        dw = be.asarray(np.concatenate(dws, axis=0))
        db = be.asarray(np.concatenate(dbs, axis=0))
        self._done.append(
            _LayerStep(name, cache.counts, self._dx_by_channels(layer), dx_counts, cache.forward, stats)
        )
        return dx, dw, db

    def _backward_dx_by_channels(self, layer, name, cache, spans, channels, messages, dy_m, dy_from_m, t0):
        """Backward with dX split by input channels, in three parts per worker.

        1. "dyc": every participant runs its tail's backward; workers send back their kernels'
           conv-output gradient (dyc) at once.
        2. "dw": dW, db of its kernels, from its dyc (sent with part 1, so a worker goes on to it
           without waiting).
        3. "dx": every participant computes dX[:, c0:c1] for its slice ``channels`` of the C input
           channels (``dx_plans``, balanced apart from the kernels), from all of dY_conv (N, F, OH, OW) and
           W[:, c0:c1]: ``conv2d_backward_input``, a GEMM with all F kernels as its inner
           dimension and a col2im of C/P channels. Split by kernels instead, every participant
           would compute a full-size partial dX (GEMM output and col2im of all C channels) to
           be summed: duplicated work that is mostly memory traffic.
        A worker's part 3 carries only the other participants' dyc (it kept its own), and goes
        out as soon as the master has them: with one worker, right after the master's own tail
        backward. So the gradients travel while everyone computes dW, and nobody waits for
        another's dW before its dX.
        Returns (dx, the master's (None, dw, db) or None, the workers' part-2 replies, stats).
        """
        be = self.backend
        weights = {}
        for k, msg in messages.items():
            msg.header["part"] = "dyc"
            header = {"task": 0, "step": cache.step, "layer": msg.header["layer"], "part": "dw"}
            weights[k] = Message("conv_backward", header)
        pending1 = self._send(messages)
        pending_w = self._send(weights)
        deadline = time.monotonic() + self.recv_timeout

        n, c, h, wd = cache.x_shape
        oh = conv_output_size(h, layer.kernel, layer.stride, layer.padding)
        ow = conv_output_size(wd, layer.kernel, layer.stride, layer.padding)
        w_host = self._host(layer.params["w"])
        dyc: dict[int, np.ndarray] = {}  # participant -> its kernels' conv-output gradient (N, e - s, OH, OW)
        second: dict[int, Message] = {}
        pending2: dict[int, int] = {}

        def send_ready() -> None:
            """Part 3 to every worker with input channels whose missing dyc the master now has."""
            for k, (s, e), (c0, c1) in zip(self.who, spans, channels, strict=True):
                others = [j for j, (s2, e2) in zip(self.who, spans, strict=True) if j != k and s2 < e2]
                if k == MASTER or c0 == c1 or k in second or not all(j in dyc for j in others):
                    continue
                arrays = {"w": np.ascontiguousarray(w_host[:, c0:c1])}
                lo = [dyc[j] for j, (s2, e2) in zip(self.who, spans, strict=True) if s2 < e2 <= s]
                hi = [dyc[j] for j, (s2, e2) in zip(self.who, spans, strict=True) if e <= s2 < e2]
                for key, around in (("dyc_lo", lo), ("dyc_hi", hi)):
                    if around:  # the kernels before this worker's, and after
                        arrays[key] = around[0] if len(around) == 1 else np.concatenate(around, axis=1)
                header = {"task": 0, "step": cache.step, "layer": messages[k].header["layer"], "part": "dx"}
                second[k] = Message("conv_backward", {**header, "dx_channels": [c0, c1]}, arrays)
                pending2.update(self._send({k: second[k]}))

        master_s, mine, d_m = 0.0, None, None
        if dy_m is not None:
            t = time.perf_counter()
            d_m = tail_backward(be, dy_m, cache.master_cache, dy_from_m)
            dyc[MASTER] = np.ascontiguousarray(owned(be, d_m, cache.master_cache))
            master_s += time.perf_counter() - t
        send_ready()
        if d_m is not None:  # the master's dW while the part-3 messages travel
            t = time.perf_counter()
            mine = conv_backward(be, d_m, cache.master_cache, need_dx=False)
            be.synchronize()
            master_s += time.perf_counter() - t
            d_m = None

        # the workers' dW results may come in meanwhile: kept for their gather, not dropped
        replies1 = self._gather("conv_backward", name, pending1, deadline, later=pending_w)
        for k, (s, e) in zip(self.who, spans, strict=True):
            if k != MASTER and s < e:
                dyc[k] = self._reply_array(k, replies1[k], "dyc", (n, e - s, oh, ow))
        send_ready()

        dx_parts: dict[int, Any] = {}
        c0, c1 = channels[0]
        if self.who[0] == MASTER and c0 < c1:
            t = time.perf_counter()
            whole = np.concatenate([dyc[k] for k, (s, e) in zip(self.who, spans, strict=True) if s < e], axis=1)
            w_c = be.asarray(np.ascontiguousarray(w_host[:, c0:c1]))
            dx_m = be.conv2d_backward_input(be.asarray(whole), w_c, (n, c1 - c0, h, wd), layer.stride, layer.padding)
            dx_parts[MASTER] = be.to_numpy(dx_m)
            master_s += time.perf_counter() - t
        deadline = time.monotonic() + self.recv_timeout
        replies_w = self._gather("conv_backward", name, pending_w, deadline, later=pending2)
        replies2 = self._gather("conv_backward", name, pending2, deadline)
        for k, (c0, c1) in zip(self.who, channels, strict=True):
            if k != MASTER and c0 < c1:
                dx_parts[k] = self._reply_array(k, replies2[k], "dx", (n, c1 - c0, h, wd))
        dx = be.asarray(np.concatenate([dx_parts[k] for k in self.who if k in dx_parts], axis=1))

        parts = [
            self._stats(t0, messages, replies1, master_s),
            self._stats(t0, weights, replies_w, 0.0),
            self._stats(t0, second, replies2, 0.0),
        ]
        stats = _OpStats(
            wall_s=parts[-1].wall_s,
            compute_s=[sum(p.compute_s[i] for p in parts) for i in range(len(self.who))],
            bytes_sent=sum(p.bytes_sent for p in parts),
            bytes_recv=sum(p.bytes_recv for p in parts),
        )
        return dx, mine, replies_w, stats

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
             "shares": {"conv1": [kernels per participant], ...},   # the plan this step used
             "dx_shares": {"conv2": [input channels per participant], ...},  # dX by channels only
             "participants": ["master", "worker0", ...],  # the order of every list here
             "participant_conv_s": [s, ...],              # each one's conv compute this step
             "ops": [{"layer": "conv1", "op": "forward", "wall_s": s, "compute_s": [s, ...]}, ...],  # each op
             "rebalanced": {"conv2": [new counts], "conv2.dx": [new channels], ...}}  # next step's ({} if none)

        What the rebalancer balances: a layer's step waits for the slowest participant of
        each op, so each op should be balanced on its own. With dX split by input channels a
        layer has two knobs: the kernel split ("conv2") is balanced on the forward's times, and
        the channel split ("conv2.dx") on the backward's, which take what the kernel split
        leaves there (the tail's backward and dW) as a fixed part. Otherwise forward and
        backward both scale with the kernels and the kernel split is balanced on their sum.

        Bytes are the arrays of the conv_forward / conv_backward tasks and of their
        results (``Message.nbytes``), counted the same for every transport: the
        in-process transport moves no bytes over a wire but they are counted anyway,
        as what a network would carry. Message headers, framing, heartbeats and
        calibration are not included (``transport.traffic()`` has the zmq totals).
        """
        ops = [op for done in self._done for op in (done.forward, done.backward)]
        per_participant = [sum(op.compute_s[i] for op in ops) for i in range(len(self.who))]
        shares = {name: list(self.plans[name]) for name in self._layer_names() if name in self.plans}
        dx_shares = {}
        measured: dict[str, tuple[list[int], list[float]]] = {}  # rebalancer key -> (counts, seconds)

        def add(key: str, counts: list[int], ops: list[_OpStats]) -> None:
            _, times = measured.setdefault(key, (counts, [0.0] * len(self.who)))
            for i in range(len(self.who)):
                times[i] += sum(op.compute_s[i] for op in ops)

        for done in self._done:
            shares[done.name] = list(done.counts)
            if not done.by_channels:
                add(done.name, done.counts, [done.forward, done.backward])
                continue
            add(done.name, done.counts, [done.forward])  # measured alike while the master works alone
            if done.dx_counts is not None:
                dx_shares[done.name] = list(done.dx_counts)
                add(f"{done.name}.dx", done.dx_counts, [done.backward])

        # the ops as they ran: the forwards, then the backwards (which finish the layers in reverse)
        ran = [(d.name, "forward", d.forward) for d in reversed(self._done)]
        ran += [(d.name, "backward", d.backward) for d in self._done]

        rebalanced = {}
        if self.rebalancer is not None:
            for key, (counts, times) in measured.items():  # a layer's kernels first, then its dX channels
                # channels of dX only for those with kernels next step: they hold a gradient to start from
                layer = key.removesuffix(".dx")
                available = [c > 0 for c in self.plans[layer]] if key.endswith(".dx") else None
                proposal = self.rebalancer.observe(key, counts, times, available)
                if proposal is not None:
                    log.info("rebalancing %s: %s -> %s (%s)", key, counts, proposal, ", ".join(self.participants))
                    if key.endswith(".dx"):
                        self.dx_plans[layer] = proposal
                    else:
                        self.plans[key] = proposal
                    rebalanced[key] = list(proposal)

        record = {
            "comm_s": sum(op.comm_s for op in ops),
            "conv_s": sum(op.conv_s for op in ops),
            "bytes_sent": sum(op.bytes_sent for op in ops),
            "bytes_recv": sum(op.bytes_recv for op in ops),
            "shares": shares,
            "dx_shares": dx_shares,
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

    def _dx_by_channels(self, layer: Conv2D) -> bool:
        """Whether ``layer``'s dX is split by input channels (when a worker has kernels)."""
        return layer.need_dx and self.dx_by_channels and bool(self.workers)

    def _dx_plan(self, name: str, channels: int, counts: list[int]) -> list[int]:
        """This layer's input channels of dX per participant; proportional to ``counts`` at first,
        and again whenever the kept split no longer fits them (someone without kernels has channels)."""
        plan = self.dx_plans.get(name)
        if plan is None or not _fits_kernels(plan, counts, channels):
            plan = self.dx_plans[name] = kernel_counts([float(k) for k in counts], channels)
        return plan

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
            bytes_sent=sum(m.nbytes() for m in messages.values()),
            bytes_recv=sum(r.nbytes() for r in replies.values()),
        )
