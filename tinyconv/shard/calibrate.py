"""Calibration: time every participant on each sharded layer's exact shape, split by the paper's eq. 1.

The paper measures each device once, on "a convolution of the layer's own shape with
random values", and gives it kernels in proportion to its speed. Here every participant
times a forward + backward of each sharded block -- the convolution and its fused tail --
on the same seeded random values (median of ``repeats`` runs after a warm-up), one
participant at a time so that devices sharing a host do not slow each other's benchmark;
the master runs the very code the workers run (:func:`time_block`). Then, per layer,
eq. 1 (``balance.py``) turns the times into weights and largest remainder into counts --
of kernels, and for a layer split by input channels of those too.

A layer's spec travels in the ``calibrate`` task (``protocol.py``) as plain values::

    {"layer": 1, "x": [N, C, H, W], "w": [F, C, K, K], "stride": 1, "padding": 2,
     "need_dx": true, "tail": [...]}
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.base import Backend, conv_output_size
from tinyconv.layers import Linear
from tinyconv.shard.balance import kernel_counts, speed_weights
from tinyconv.shard.block import block_backward, block_forward, check_tail, tail_output_hw
from tinyconv.shard.protocol import TaskError
from transports.base import Message

if TYPE_CHECKING:
    from tinyconv.model import Network
    from tinyconv.shard.cluster import Cluster


@dataclass(frozen=True)
class Spec:
    """One layer to time: its input and weight shapes, and the block around its convolution."""

    layer: int
    x: tuple[int, int, int, int]  # (N, C, H, W)
    w: tuple[int, int, int, int]  # (F, C, K, K)
    stride: int
    padding: int
    need_dx: bool
    tail: list[dict[str, Any]]

    @property
    def y(self) -> tuple[int, int, int, int]:
        """The block's output shape (N, F, OH', OW'), after the tail."""
        n, _, h, w = self.x
        oh, ow = (conv_output_size(s, self.w[2], self.stride, self.padding) for s in (h, w))
        return (n, self.w[0], *tail_output_hw(oh, ow, self.tail))

    def floats(self) -> int:
        """About how many floats timing it holds at once: the im2col columns, C*KH*KW x N*OH*OW,
        next to x, dx, w, y and dy."""
        n, c, h, w = self.x
        f, _, kh, kw = self.w
        oh, ow = (conv_output_size(s, k, self.stride, self.padding) for s, k in ((h, kh), (w, kw)))
        return c * kh * kw * n * oh * ow + 2 * math.prod(self.x) + math.prod(self.w) + 6 * n * f * oh * ow


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_spec(i: int, spec: Any, max_bytes: int | None = None) -> Spec:
    """Layer spec ``i`` of a calibrate task, checked; a TaskError naming what is wrong."""
    allowed = {"layer", "x", "w", "stride", "padding", "need_dx", "tail"}
    if not isinstance(spec, dict) or set(spec) != allowed:
        raise TaskError(
            f"layers[{i}] must be a map with layer, x [N,C,H,W], w [F,C,K,K], stride, padding, need_dx, tail; "
            f"got {spec!r:.200}"
        )
    for name in ("x", "w"):
        shape = spec[name]
        if not (isinstance(shape, list) and len(shape) == 4 and all(_is_int(s) and s > 0 for s in shape)):
            raise TaskError(f"layers[{i}].{name} must be 4 positive ints, got {shape!r:.100}")
    if not (all(_is_int(spec[k]) for k in ("layer", "stride", "padding")) and isinstance(spec["need_dx"], bool)):
        raise TaskError(f"layers[{i}]: layer, stride, padding must be ints and need_dx a bool")
    if spec["x"][1] != spec["w"][1] or spec["stride"] < 1 or spec["padding"] < 0:
        raise TaskError(f"layers[{i}]: x {spec['x']} and w {spec['w']} need the same C, stride >= 1, padding >= 0")
    try:
        parsed = Spec(
            spec["layer"],
            tuple(spec["x"]),
            tuple(spec["w"]),
            spec["stride"],
            spec["padding"],
            spec["need_dx"],
            check_tail(spec["tail"]),
        )
        parsed.y  # noqa: B018 -- raises ValueError if the kernel or a pool does not fit
    except ValueError as e:
        raise TaskError(f"layers[{i}]: {e}") from None
    if max_bytes is not None and 4 * parsed.floats() > max_bytes:
        raise TaskError(
            f"layers[{i}]: timing x {list(parsed.x)}, w {list(parsed.w)} needs about {4 * parsed.floats()} bytes, "
            f"over this worker's limit of {max_bytes}"
        )
    return parsed


def time_block(be: Backend, spec: Spec, repeats: int) -> float:
    """Median seconds of a forward + backward of ``spec``'s block on ``be``, after a warm-up run.

    The values are random but seeded by the layer, the same on every participant: only the
    device differs. The warm-up keeps first-call costs (allocation, kernel compilation) out."""
    rng = np.random.default_rng(spec.layer)
    x = be.asarray(rng.standard_normal(spec.x, dtype=np.float32))
    w = be.asarray(rng.standard_normal(spec.w, dtype=np.float32) * np.float32(0.1))
    b = be.asarray(rng.standard_normal(spec.w[0], dtype=np.float32))
    dy = be.asarray(rng.standard_normal(spec.y, dtype=np.float32))

    def once() -> float:
        t0 = time.perf_counter()
        _, cache = block_forward(be, x, w, b, spec.stride, spec.padding, spec.tail)
        block_backward(be, dy, cache, spec.need_dx)
        be.synchronize()
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(repeats))


def block_inputs(net: Network, batch_size: int, image_size: int) -> list[tuple[int, ...]]:
    """The input shape (N, C, H, W) of each sharded block of ``net``, for square images."""
    from tinyconv.shard.layer import ShardedBlock

    blocks = [layer for layer in net.layers if isinstance(layer, ShardedBlock)]
    shape: tuple[int, ...] = (batch_size, blocks[0].conv.in_channels, image_size, image_size)
    inputs = []
    for layer in net.layers:
        if isinstance(layer, Linear):
            break
        if isinstance(layer, ShardedBlock):
            inputs.append(shape)
        shape = layer.output_shape(shape)
    return inputs


def calibrate(cluster: Cluster, net: Network, batch_size: int, image_size: int = 32) -> dict[str, Any]:
    """Time every participant on each of ``net``'s sharded layers; set each layer's plan by eq. 1.

    The times also go to the rebalancer, if any, as each participant's time for all F kernels
    (all C channels) of the layer: with the first step's, at the calibrated split, it has two
    counts per participant to fit its fixed and per-unit cost (``rebalance.py``). Returns::

        {"participants": [...], "times": {"conv1": [s, ...], ...},
         "shares": {"conv1": [kernels, ...], ...}, "channel_shares": {"conv2": [channels, ...]},
         "shapes": {"conv1": {"x": [...], "w": [...]}, ...}}
    """
    specs = []
    for block, x in zip(cluster.blocks, block_inputs(net, batch_size, image_size), strict=True):
        c = block.conv
        w = [c.out_channels, c.in_channels, c.kernel, c.kernel]
        specs.append({"layer": block.index, "x": list(x), "w": w, "stride": c.stride, "padding": c.padding,
                      "need_dx": c.need_dx, "tail": block.tail})  # fmt: skip
    repeats = cluster.calibration_repeats
    times: dict[int | None, list[float]] = {}
    for w in cluster.workers:  # one at a time
        op = cluster.rpc.op("calibration")
        task = op.send(w.index, Message("calibrate", {"layers": specs, "repeats": repeats}))
        reply = op.gather([task])[w.index]
        times[w.index] = _times(cluster, w.index, reply.header["times"], len(specs))
    if ("master", None) in cluster.seats:
        times[None] = [time_block(cluster.backend, parse_spec(i, s), repeats) for i, s in enumerate(specs)]

    result: dict[str, Any] = {"participants": cluster.participants, "times": {}, "shares": {}, "channel_shares": {}}
    result["shapes"] = {}
    for i, (block, spec) in enumerate(zip(cluster.blocks, specs, strict=True)):
        name, c = block.name, block.conv
        layer_times = [times[k][i] for _, k in cluster.seats]
        weights = speed_weights(layer_times)
        cluster.counts[name] = kernel_counts(weights, c.out_channels)
        unit = c.out_channels  # what the rebalancer moves: the input channels of a layer split by them
        if block.by_channels:
            cluster.channel_counts[name] = kernel_counts(weights, c.in_channels)
            result["channel_shares"][name] = list(cluster.channel_counts[name])
            unit = c.in_channels
        if cluster.rebalancer is not None:  # each participant measured on the whole layer: its first (k, t)
            cluster.rebalancer.record(name, [unit] * len(cluster.seats), layer_times)
        result["times"][name] = layer_times
        result["shares"][name] = list(cluster.counts[name])
        result["shapes"][name] = {"x": spec["x"], "w": spec["w"]}
    return result


def _times(cluster: Cluster, k: int, times: Any, n_layers: int) -> list[float]:
    if not (isinstance(times, list) and len(times) == n_layers and all(_positive(t) for t in times)):
        raise RuntimeError(
            f"{cluster.rpc.describe(k)} answered calibrate with times {times!r:.200}, expected {n_layers} "
            "positive seconds (one per sharded layer); is it running the same tinyconv version?"
        )
    return [float(t) for t in times]


def _positive(t: Any) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
