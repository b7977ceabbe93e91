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
3. **bytes** -- per worker and op, as ``eq2.py`` counts them (the sum over workers and ops is
   ``comm.split_bytes``, which agrees with a real step's measured bytes exactly), each array in
   the word of its role under ``--wire-precision`` (``comm.wire_words``: weights w, b; maps x,
   y; grads dy, dw, db, dx -- 4 bytes in fp32, 3 in adt24, 2 in bf16 and fp16, 1 in s8 and a
   4-byte scale per plane). Split by kernels, forward: x (maps) and the rows of w and b
   (weights) of its h_i kernels out, its k_i output (or pooled) maps back; backward: the
   gradient of its h_i maps out, dw and db of its k_i kernels and (but for the first layer) a
   whole partial dX back (grads): ``comm.block_bytes``, one worker's terms, whose sums over
   workers are ``comm.split_bytes`` (the tests hold them to it for every format).
   Split by input channels (tinyconv's
   default with every worker on the master's host), ``comm.channel_split_bytes`` of the
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

6. **the rebalancer's view** -- what ``Rebalancer`` would see of this split (``lag``): per layer,
   each participant's forward + backward until its share is at the master, the master's compute,
   a worker's compute plus its bytes / B (``LayerStep.ready_s``), and the slowest's lag behind
   their mean, (max r - mean r) / mean r. Eq. 1 balances compute only, so on a slow link the
   workers lag by their transfers; past the rebalancer's threshold (10 %), ``--rebalance on``
   moves kernels towards the master during the steps, which this model, a fixed split, does not
   follow (``against.py`` leaves such rows out).

Not modelled: the master's own copies of what comes back (concatenating maps, summing N partial
dX, which tinyconv counts as comm), protocol overhead, narrowing and widening the words (a few
vectorised passes, counted as comm by tinyconv), and a rebalancer moving kernels after the
calibrated split. ``adaptive`` is predicted at AWP's start (weights bf16, maps s8, gradients
bf16): its weights widen only as training settles, which one step's prediction does not follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tinyconv.distributed.shard.balance import apportion, speed_weights
from tinyconv.distributed.shard.plan import Plan
from tinyconv.lab.eq2 import FP32_WORDS, ConvShape, block_bytes, channel_split_bytes, wire_words
from tinyconv.lab.simulate.devices import Device
from tinyconv.lab.simulate.link_model import LinkModel, Task, op_wall

# the splits a prediction is made for, (fuse, split) as the main job's --fuse and --split, by the CSV's label
LABELS = {
    ("off", "kernels"): "paper",
    ("on", "kernels"): "tinyconv fused",
    ("on", "channels"): "tinyconv channels",
    ("off", "channels"): "tinyconv channels unfused",
}


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
    lag: float = 0.0  # the largest (max - mean) / mean of a layer's ready times (6. in the module docstring)


@dataclass(frozen=True)
class PredictedOp:
    """One op of one layer: the master's compute and each worker's task."""

    master_s: float
    tasks: tuple[Task, ...]


def words_of(wire: str) -> dict[str, str]:
    """The format of each role (weights, maps, grads) under ``--wire-precision wire``, as
    ``tinyconv comm`` counts them; ``adaptive`` at AWP's start. A ValueError for an unknown format."""
    from tinyconv.distributed.adaptive_precision import SETTINGS

    if wire not in SETTINGS:
        raise ValueError(f"wire precision must be one of {', '.join(SETTINGS)}, got {wire!r}")
    return wire_words(wire)[0][1]  # adaptive: (start, settled) -- its start


def participants(devices: Sequence[Device], nodes: int) -> list[Device]:
    """``nodes`` participants, the devices in turn (the first is the master's): one device given
    makes homogeneous copies of it."""
    return [devices[i % len(devices)] for i in range(nodes)]


def layer_ops(
    conv: ConvShape,
    parts: Sequence[Device],
    layer: int,
    fuse: str,
    split: str,
    words: dict[str, str] = FP32_WORDS,
    counts: Sequence[int] | None = None,
) -> tuple[PredictedOp, PredictedOp, list[int]]:
    """The forward and backward op of conv layer ``layer`` (index into the devices' layers) among
    ``parts``, and its kernels per participant: ``counts`` if given, else eq. 1's; arrays in
    ``words`` (role -> wire format)."""
    f, c = conv.w[0], conv.w[1]
    costs = [d.fuse[fuse].layers[layer] for d in parts]
    if counts is None:
        counts = apportion(speed_weights([cost.time(f) for cost in costs]), f)  # eq. 1
    elif len(counts) != len(parts) or sum(counts) != f or min(counts) < 0:
        raise ValueError(f"{conv.name}: a split of {f} kernels among {len(parts)} participants, got {list(counts)}")
    counts = list(counts)
    tail = list(conv.tail) if fuse == "on" else []
    placement = [("master", None)] + [(f"worker{i}", i) for i in range(len(parts) - 1)]
    plan = Plan.of(placement, counts, tail)
    computed = [p.halo.stop - p.halo.start if p.n_kernels else 0 for p in plan.participants]
    times = [cost.time(h) for cost, h in zip(costs, computed, strict=True)]
    forward = 1 / (2 + conv.need_dx)  # of the layer's time: 1 GEMM of 2 or 3

    by_channels = split == "channels" and conv.need_dx and min(c, f) >= len(parts) and len(parts) > 1
    if by_channels:
        to, back = channel_split_bytes(conv, counts, fuse=fuse == "on", words=words)
        ks, done = sum(counts[1:]), 0
    fwd, bwd = [], []
    for p, h, t in zip(plan.participants[1:], computed[1:], times[1:], strict=True):
        if not p.n_kernels:
            continue
        if by_channels:  # the layer's bytes, shared by kernels (rounded so they add up), half in each op
            to_i = round(to * (done + p.n_kernels) / ks) - round(to * done / ks)
            back_i = round(back * (done + p.n_kernels) / ks) - round(back * done / ks)
            done += p.n_kernels
            to_f, back_f = to_i // 2, back_i // 2
            to_b, back_b = to_i - to_f, back_i - back_f
        else:
            to_f, back_f, to_b, back_b = block_bytes(conv, h, p.n_kernels, tail, words)
        fwd.append(Task(to_f, forward * t, back_f, p.worker))
        bwd.append(Task(to_b, (1 - forward) * t, back_b, p.worker))
    return PredictedOp(forward * times[0], tuple(fwd)), PredictedOp((1 - forward) * times[0], tuple(bwd)), counts


def predict(
    convs: Sequence[ConvShape],
    devices: Sequence[Device],
    nodes: int,
    fuse: str,
    split: str,
    link: LinkModel,
    wire: str = "fp32",
    shares: Sequence[Sequence[int]] | None = None,
) -> Prediction:
    """The step of ``nodes`` participants (``devices`` in turn, the master first) with ``fuse`` and
    ``split`` on ``link``, the shards in ``--wire-precision wire``: the model in the module docstring.
    ``shares``: each conv layer's kernels per participant, instead of eq. 1's (a split that was
    measured, e.g. a grid row's with ``--rebalance off``)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if shares is not None and len(shares) != len(convs):
        raise ValueError(f"shares for {len(shares)} conv layers, the network has {len(convs)}")
    words = words_of(wire)
    parts = participants(devices, nodes)
    master = parts[0]
    wall = conv = lag = 0.0
    sent = recv = 0
    split_as = []
    for layer, shape in enumerate(convs):
        given = None if shares is None else shares[layer]
        forward, backward, counts = layer_ops(shape, parts, layer, fuse, split, words, given)
        split_as.append(tuple(counts))
        for op in (forward, backward):
            wall += op_wall(link, op.master_s, op.tasks)
            conv += max([op.master_s] + [t.compute for t in op.tasks])
            sent += sum(t.to for t in op.tasks)
            recv += sum(t.back for t in op.tasks)
        lag = max(lag, ready_lag(forward, backward, counts[0] > 0, link))
    comp = master.fuse[fuse].comp_s
    step = comp + wall
    alone = comp + sum(cost.time(cost.kernels) for cost in master.fuse[fuse].layers)
    return Prediction(nodes, step, wall - conv, conv, comp, alone / step, sent, recv, tuple(split_as), lag)


def ready_lag(forward: PredictedOp, backward: PredictedOp, master_busy: bool, link: LinkModel) -> float:
    """How far the slowest of a layer's participants lags their mean, (max r - mean r) / mean r, in
    ready times r as the rebalancer measures them: the master's compute, a worker's compute plus the
    bytes it moved / its rate (``LayerStep.ready_s``); participants without kernels left out."""
    ready = [forward.master_s + backward.master_s] if master_busy else []
    ready += [
        f.compute + b.compute + (f.to + f.back + b.to + b.back) / link.rate(f.worker)
        for f, b in zip(forward.tasks, backward.tasks, strict=True)
    ]
    mean = sum(ready) / len(ready) if ready else 0.0
    return (max(ready) - mean) / mean if mean > 0 else 0.0
