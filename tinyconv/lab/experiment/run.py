"""Timing one cell: training steps of the master alone and of the master with its workers, alternated.

A step is forward, loss, backward and the SGD update on random CIFAR-shaped data
(:func:`one_step`). A distributed cell calibrates, runs ``warmup`` untimed distributed steps
(the rebalancer settles; with ``cell.rebalance`` "off" there is none, and every step keeps the
calibrated split), then alternates solo and distributed steps (:func:`alternate`):
``cluster.detach`` puts the network's own layers back for a solo step, ``cluster.attach``
shards them again, and after every switch ``settle`` untimed steps run first, so that a timed
step never runs on the caches the other configuration left behind (the master alone's, more while
they still fault memory in: :func:`settle_solo`). A drift in the shared
machine's speed thus hits both sides of the speedup alike. The master alone (participants 1)
runs its warm-up and timed steps, then one step timed layer by layer (:func:`solo_split`) to
split it into conv and comp, as the paper's Fig. 6 does. ``benchmarks/bench_speedup.py``
prints the same measurements for one configuration, in more detail. The shards travel in
``cell.wire`` (``Cluster(wire_precision=)``); the bytes in a row are those that crossed, as
narrowed, and a narrowed wire's row names the words each layer's weights / maps / gradients
took in its last step (``wire_formats``) and how many arrays fell back to float32. A layer split
by input channels goes in chunks of ``cell.pipeline`` images (``Cluster(pipeline=)``; "0": the
whole batch at once).

A data-parallel cell (``cell.parallel == "data"``, ``tinyconv/distributed/replica/``) alternates the same
way, a solo step against one of the replicas (:func:`data_step`), which need no attaching; a
hybrid cell (``"hybrid"``: the convolutions by images, the classifier on the master) likewise,
with ``Hybrid`` in place of ``Replicas`` (both a ``BatchSplit``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backends.base import Backend
from tinyconv.distributed.pool import PARALLEL
from tinyconv.distributed.rebalance import Rebalancer
from tinyconv.distributed.runtime import Runtime
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.lab.experiment.grid import BY_IMAGES, DATA_WIRE, Cell
from tinyconv.layers import Conv2D
from tinyconv.model import Network, paper_net, parse_arch
from tinyconv.optim import SGD
from transports.base import Transport, WorkerInfo

# A solo step does no I/O, so time it spends in the kernel is memory being faulted in: after a switch from
# distributed steps the master's kept heap (tinyconv/distributed/heap.py) may lack a block the size of the whole layer's
# columns, and its fresh 2 MB pages cost seconds (150:800 at 256: 5.9 s of a 16.7 s step). After the
# settling steps, up to SETTLE_MORE more run while the last spent over KERNEL_FRACTION of its time there.
SETTLE_MORE = 3
KERNEL_FRACTION = 0.01
REBALANCE_THRESHOLD = 0.03  # bench_speedup's default: the rebalancer acts on a 3 % lag
RECV_TIMEOUT_S = 600.0  # the longest a worker may take over one op of the largest cell


def one_step(net: Network, opt: SGD, x: Any, y: np.ndarray, cluster: Cluster | None) -> dict[str, Any]:
    """One training step (forward, loss, backward, SGD); its time, the part of it the process spent in the
    kernel (``kernel_s``, for :func:`settle_solo`) and the paper's split."""
    t, kernel = time.perf_counter(), os.times().system
    net.train_step(x, y)
    opt.step()
    net.backend.synchronize()
    dt, kernel_s = time.perf_counter() - t, os.times().system - kernel
    split = cluster.last_step if cluster is not None else {"comm_s": 0.0, "conv_s": 0.0, "participant_conv_s": []}
    return {"time_s": dt, "kernel_s": kernel_s, **split, "comp_s": max(0.0, dt - split["comm_s"] - split["conv_s"])}


def settle_solo(step: Callable[[], dict[str, Any]], settle: int) -> None:
    """``settle`` untimed solo steps after a switch, then up to SETTLE_MORE more while the last one still
    spent over KERNEL_FRACTION of its time in the kernel, faulting in memory (``settle`` 0: none at all)."""
    for i in range(settle + SETTLE_MORE if settle else 0):
        record = step()
        if i + 1 >= settle and record["kernel_s"] <= KERNEL_FRACTION * record["time_s"]:
            return


def data_step(net: Network, opt: SGD, x: Any, y: np.ndarray, replicas: Runtime) -> dict[str, Any]:
    """One data-parallel (or hybrid) training step (the replicas' forward and backward, the master's
    SGD); its time and split as :func:`one_step`'s."""
    t = time.perf_counter()
    replicas.train_batch(net, x, y)
    opt.step()
    net.backend.synchronize()
    dt = time.perf_counter() - t
    split = replicas.last_step
    return {"time_s": dt, **split, "comp_s": max(0.0, dt - split["comm_s"] - split["conv_s"])}


def solo_split(net: Network, x: Any, y: np.ndarray) -> dict[str, float]:
    """The master alone, layer by layer: conv (the conv layers) vs comp (everything else)."""
    conv_s = 0.0
    t0 = time.perf_counter()
    a = x
    for layer in net.layers:
        t = time.perf_counter()
        a = layer.forward(a, training=True)
        if isinstance(layer, Conv2D):
            conv_s += time.perf_counter() - t
    _, d = net.loss_fn(a, y)
    for layer in reversed(net.layers):
        t = time.perf_counter()
        d = layer.backward(d)
        if isinstance(layer, Conv2D):
            conv_s += time.perf_counter() - t
        if d is None:
            break
    net.backend.synchronize()
    return {"conv_s": conv_s, "time_s": time.perf_counter() - t0}


def alternate(
    net: Network, opt: SGD, x: Any, y: np.ndarray, cluster: Cluster, steps: int, settle: int,
    tick: Callable[[], None] = lambda: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """``steps`` solo and ``steps`` distributed steps, alternated, each after ``settle`` untimed ones.
    Returns (solo records, distributed records); leaves the network attached. ``tick`` after each pair."""
    solo, dist = [], []
    for _ in range(steps):
        cluster.detach(net)  # the network's own layers: the master alone, the workers wait
        settle_solo(lambda: one_step(net, opt, x, y, None), settle)
        solo.append(one_step(net, opt, x, y, None))
        cluster.attach(net)
        for _ in range(settle):
            one_step(net, opt, x, y, cluster)
        dist.append(one_step(net, opt, x, y, cluster))
        tick()
    return solo, dist


def med(recs: Sequence[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in recs)


def training_setup(arch: str, norm: str, batch: int, be: Backend) -> tuple[Network, SGD, Any, np.ndarray]:
    """The network, its optimiser and one seeded random batch, as every cell and bench_speedup use."""
    rng = np.random.default_rng(0)
    x = be.asarray(rng.standard_normal((batch, 3, 32, 32)).astype(np.float32))
    y = rng.integers(0, 10, batch)
    net = paper_net(parse_arch(arch), be, norm, seed=0)
    return net, SGD(net, 0.001, momentum=0.9, weight_decay=5e-4), x, y


def run_cell(
    cell: Cell, be: Backend, transport: Transport | None, workers: Sequence[WorkerInfo], steps: int, warmup: int,
    settle: int,
) -> dict[str, Any]:  # fmt: skip
    """Measure ``cell``: the master alone, or with the first participants - 1 of ``workers`` over
    ``transport``. Returns the measured columns of its row (``table.COLUMNS``)."""
    net, opt, x, y = training_setup(cell.arch, cell.norm, cell.batch, be)
    if cell.participants == 1:
        return _alone(net, opt, x, y, steps, warmup)
    if transport is None or len(workers) < cell.participants - 1:
        raise RuntimeError(f"{cell.label()} needs {cell.participants - 1} workers, the grid has {len(workers)}")
    if cell.parallel in BY_IMAGES:
        return _data_parallel(cell, net, opt, x, y, be, transport, workers, steps, warmup, settle)
    if cell.parallel != "model":  # a new --parallel needs its own runner here, not the model split by default
        raise ValueError(f"{cell.label()}: the grid has no runner for --parallel {cell.parallel}")
    cluster = Cluster(transport, workers[: cell.participants - 1], be, master_share="auto",
                      rebalance=cell.rebalance == "on", rebalancer=Rebalancer(threshold=REBALANCE_THRESHOLD),
                      recv_timeout=RECV_TIMEOUT_S, fuse=cell.fuse == "on", split=cell.split,
                      wire_precision=cell.wire, pipeline=int(cell.pipeline))  # fmt: skip
    try:
        cluster.calibrate(net, cell.batch)
        for _ in range(warmup):
            one_step(net, opt, x, y, cluster)
        solo, dist = alternate(net, opt, x, y, cluster, steps, settle)
    finally:
        cluster.close()  # the network's own layers back; the workers stay, for the next cell
    return {**_row(solo, dist), "speeds": speeds_text(cluster.calibration)}


def _row(solo: list[dict[str, Any]], dist: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured columns of a distributed cell from its alternated solo and distributed steps."""
    times = [r["time_s"] for r in dist]
    step_s, solo_s = statistics.median(times), med(solo, "time_s")
    last = dist[-1]
    return {
        "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
        "comm_s": med(dist, "comm_s"), "conv_s": med(dist, "conv_s"), "comp_s": med(dist, "comp_s"),
        "bytes_sent": int(med(dist, "bytes_sent")), "bytes_recv": int(med(dist, "bytes_recv")),
        "solo_step_s": solo_s, "speedup": solo_s / step_s,
        "shares": shares_text(last["shares"]), "channel_shares": shares_text(last.get("channel_shares", {})),
        "wire_fallbacks": sum(r.get("wire_fallbacks", 0) for r in dist),
        "wire_formats": formats_text(last.get("wire_precision", {})),
    }  # fmt: skip


def _data_parallel(
    cell: Cell, net: Network, opt: SGD, x: Any, y: np.ndarray, be: Backend, transport: Transport,
    workers: Sequence[WorkerInfo], steps: int, warmup: int, settle: int,
) -> dict[str, Any]:  # fmt: skip
    """A data-parallel or hybrid cell: replicas calibrated, warmed up, then solo and their steps alternated."""
    if cell.wire != DATA_WIRE:
        raise ValueError(f"{cell.label()}: {cell.parallel}-parallel replicas send {DATA_WIRE} only, not {cell.wire}")
    split_by = PARALLEL[cell.parallel]
    replicas = split_by(transport, workers[: cell.participants - 1], be, master_share="auto",
                        rebalance=cell.rebalance == "on", rebalancer=Rebalancer(threshold=REBALANCE_THRESHOLD),
                        recv_timeout=RECV_TIMEOUT_S)  # fmt: skip
    replicas.calibrate(net, cell.batch)
    for _ in range(warmup):
        data_step(net, opt, x, y, replicas)
    solo, dist = [], []
    for _ in range(steps):
        settle_solo(lambda: one_step(net, opt, x, y, None), settle)
        solo.append(one_step(net, opt, x, y, None))
        for _ in range(settle):
            data_step(net, opt, x, y, replicas)
        dist.append(data_step(net, opt, x, y, replicas))
    return {**_row(solo, dist), "speeds": speeds_text(replicas.calibration)}


def _alone(net: Network, opt: SGD, x: Any, y: np.ndarray, steps: int, warmup: int) -> dict[str, Any]:
    """The master alone: its timed steps, conv and comp from one more step timed layer by layer."""
    for _ in range(warmup):
        one_step(net, opt, x, y, None)
    times = [one_step(net, opt, x, y, None)["time_s"] for _ in range(steps)]
    split = solo_split(net, x, y)
    step_s = statistics.median(times)
    conv_s = step_s * split["conv_s"] / split["time_s"]  # the layer-by-layer step's fraction, of the median step
    kernels = {f"conv{i + 1}": [layer.out_channels] for i, layer in enumerate(_convs(net))}
    return {
        "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
        "comm_s": 0.0, "conv_s": conv_s, "comp_s": step_s - conv_s, "bytes_sent": 0, "bytes_recv": 0,
        "solo_step_s": step_s, "speedup": 1.0, "shares": shares_text(kernels), "channel_shares": "",
        "wire_fallbacks": 0, "wire_formats": "", "speeds": "1",
    }  # fmt: skip


def _convs(net: Network) -> list[Conv2D]:
    return [layer for layer in net.layers if isinstance(layer, Conv2D)]


def speeds_text(calibration: dict[str, Any] | None) -> str:
    """Each participant's speed beside the master's, from the calibration's times summed over the units:
    "1/0.98/0.49" (the master first; eq. 1 splits by these). Empty without a calibration or with a time missing."""
    if not calibration or any(t is None for ts in calibration["times"].values() for t in ts):
        return ""
    totals = [sum(column) for column in zip(*calibration["times"].values(), strict=True)]
    return "/".join(f"{totals[0] / t:.3g}" for t in totals)


def shares_text(shares: dict[str, Sequence[int]]) -> str:
    """{"conv1": [25, 25], "conv2": [240, 260]} -> "conv1=25/25 conv2=240/260": per layer, the
    kernels (or input channels) of each participant, the master first."""
    return " ".join(f"{layer}={'/'.join(str(k) for k in counts)}" for layer, counts in shares.items())


def formats_text(formats: dict[str, dict[str, str]]) -> str:
    """{"conv1": {"weights": "bf16", "maps": "bf16", "grads": "bf16"}, ...} -> "conv1=bf16/bf16/bf16 ...":
    per layer, the words its weights / maps / gradients travelled in (a narrowed wire's step record;
    empty at fp32, which records none)."""
    return " ".join(f"{layer}={'/'.join(roles.get(k, '?') for k in ('weights', 'maps', 'grads'))}"
                    for layer, roles in formats.items())  # fmt: skip
