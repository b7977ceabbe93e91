"""A training step's time for N participants, from measured devices, the bytes model and a link model.

For N participants (the master first; devices from the file, ``devices.py``), tails fused or
not (``fuse``), each conv layer l with F_l kernels:

1. **shares** -- the paper's eq. 1 on each participant's measured time for the whole layer,
   w_i ∝ 1 / t_i(F_l), whole kernels by largest remainder (``balance.py``), as
   ``Cluster.calibrate`` splits; no rebalancing.
2. **compute** -- participant i computes its k_i kernels, with the tails fused also their halo
   (``plan.py``: up to 4 more on each side for LRN), h_i of them, in
   t_i = fixed_i + per_kernel_i * h_i (``cost.py``'s affine model, the device file's numbers).
   The file has forward + backward together; the forward is taken as 1 / (2 + need_dx) of it
   (one GEMM against the backward's dW and, but for the first layer, dX).
3. **bytes** -- per worker and op, as ``comm.py`` counts them (the sum over workers and ops is
   ``comm.split_bytes``, which agrees with a real step's measured bytes exactly). Split by
   kernels, forward: x and the rows of w and b of its h_i kernels out, its k_i output (or
   pooled) maps back; backward: the gradient of its h_i maps out, dw and db of its k_i kernels
   and (but for the first layer) a whole partial dX back. Split by input channels (tinyconv's
   default with at most two workers on the master's host), ``comm.channel_split_bytes`` of the
   layer, shared among the workers in proportion to their kernels, half in each op -- and the
   compute taken as that of the fused split by kernels (an approximation: the channel split's
   point is to not repeat the im2col of the whole input, which this does not credit).
4. **one op** -- its wall time on the link, ``link.op_wall`` (the master computes its own share
   meanwhile); its conv time is the slowest participant's compute, its comm the rest, as the
   step's metrics count them (``accounting.py``).
5. **the step** -- ops do not overlap (each layer needs the last one's output), nor does the
   master's other work, so::

       step = comp + sum over ops of wall_op,   conv = sum_op max_i t_i,op,   comm = step - comp - conv
       speedup = step(1) / step,   step(1) = comp + sum_l t_master(F_l)

   with comp the master's (``devices.py``). step(1) is the model's own master alone, so that
   every split's speedup is against the same model; it differs from the measured solo step by
   what the layers timed alone differ from the same layers within a step.

Not modelled: the master's own copies of what comes back (concatenating maps, summing N partial
dX, which tinyconv counts as comm), protocol overhead, and a rebalancer moving kernels after
the calibrated split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tinyconv.comm import F32, ConvShape, channel_split_bytes
from tinyconv.shard.balance import kernel_counts, speed_weights
from tinyconv.shard.block import tail_output_hw
from tinyconv.shard.plan import Plan
from tinyconv.simulate.devices import Device
from tinyconv.simulate.link import Link, Task, op_wall

# the splits a prediction is made for: (fuse, split), as the main job's --fuse and --split
SPLITS = (("off", "kernels"), ("on", "kernels"), ("on", "channels"))
LABELS = {("off", "kernels"): "paper", ("on", "kernels"): "tinyconv fused", ("on", "channels"): "tinyconv channels"}


@dataclass(frozen=True)
class Prediction:
    """One predicted training step of ``nodes`` participants."""

    nodes: int
    step_s: float
    comm_s: float
    conv_s: float
    comp_s: float
    speedup: float
    bytes_sent: int  # to the workers, array bytes
    bytes_recv: int
    shares: tuple[tuple[int, ...], ...]  # kernels per participant, per conv layer


@dataclass(frozen=True)
class Op:
    """One op of one layer: the master's compute and each worker's task."""

    master_s: float
    tasks: tuple[Task, ...]


def participants(devices: Sequence[Device], nodes: int) -> list[Device]:
    """``nodes`` participants, the devices in turn (the first is the master's): one device given
    makes homogeneous copies of it."""
    return [devices[i % len(devices)] for i in range(nodes)]


def layer_ops(conv: ConvShape, parts: Sequence[Device], layer: int, fuse: str, split: str) -> tuple[Op, Op, list[int]]:
    """The forward and backward op of conv layer ``layer`` (index into the devices' layers) among
    ``parts``, and its kernels per participant."""
    f, c = conv.w[0], conv.w[1]
    costs = [d.fuse[fuse].layers[layer] for d in parts]
    counts = kernel_counts(speed_weights([cost.time(f) for cost in costs]), f)  # eq. 1
    tail = list(conv.tail) if fuse == "on" else []
    seats = [("master", None)] + [(f"worker{i}", i) for i in range(len(parts) - 1)]
    plan = Plan.of(seats, counts, tail)
    computed = [p.halo.stop - p.halo.start if p.n_kernels else 0 for p in plan.participants]
    times = [cost.time(h) for cost, h in zip(costs, computed, strict=True)]
    forward = 1 / (2 + conv.need_dx)  # of the layer's time: 1 GEMM of 2 or 3

    x_bytes = math.prod(conv.x) * F32
    kernel = math.prod(conv.w[1:]) * F32 + F32  # one kernel's weights and bias
    maps = conv.y[0] * math.prod(tail_output_hw(*conv.y[2:], tail)) * F32  # one kernel's (tail's) maps
    by_channels = split == "channels" and conv.need_dx and min(c, f) >= len(parts) and len(parts) > 1
    if by_channels:
        to, back = channel_split_bytes(conv, counts, fuse=fuse == "on")
        ks = sum(counts[1:])
    fwd, bwd = [], []
    for p, h, t in zip(plan.participants[1:], computed[1:], times[1:], strict=True):
        if not p.n_kernels:
            continue
        if by_channels:  # the layer's bytes, shared by kernels, half in each op
            share = p.n_kernels / ks
            to_f = to_b = round(to * share / 2)
            back_f = back_b = round(back * share / 2)
        else:
            to_f, back_f = x_bytes + h * kernel, p.n_kernels * maps
            to_b, back_b = h * maps, p.n_kernels * kernel + (x_bytes if conv.need_dx else 0)
        fwd.append(Task(to_f, forward * t, back_f))
        bwd.append(Task(to_b, (1 - forward) * t, back_b))
    return Op(forward * times[0], tuple(fwd)), Op((1 - forward) * times[0], tuple(bwd)), counts


def predict(convs: Sequence[ConvShape], devices: Sequence[Device], nodes: int, fuse: str, split: str,
            link: Link) -> Prediction:  # fmt: skip
    """The step of ``nodes`` participants (``devices`` in turn, the master first) with ``fuse`` and
    ``split`` on ``link``: the model in the module docstring."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    parts = participants(devices, nodes)
    master = parts[0]
    wall = conv = 0.0
    sent = recv = 0
    shares = []
    for layer, shape in enumerate(convs):
        *ops, counts = layer_ops(shape, parts, layer, fuse, split)
        shares.append(tuple(counts))
        for op in ops:
            wall += op_wall(link, op.master_s, op.tasks)
            conv += max([op.master_s] + [t.compute for t in op.tasks])
            sent += sum(t.to for t in op.tasks)
            recv += sum(t.back for t in op.tasks)
    comp = master.fuse[fuse].comp_s
    step = comp + wall
    alone = comp + sum(cost.time(cost.kernels) for cost in master.fuse[fuse].layers)
    return Prediction(nodes, step, wall - conv, conv, comp, alone / step, sent, recv, tuple(shares))
