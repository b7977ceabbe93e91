"""The measured device file: what each device costs per conv layer, and the master's other work.

    tinyconv simulate --measure --device-file devices.json --arch 300:1000 --batch-size 64

times THIS machine (one BLAS thread: one paper-style CPU) and adds it to the file, or replaces
its entry for the same name, arch, norm, batch size and CPU quota. Measured inside a quota
(``python -m tinyconv.lab.experiment.cpu_quota --cores 0.5 -- tinyconv simulate --measure ...``), the
entry records it as ``"cores": 0.5``: an emulated device of the experiment grid's ``--cpu-quota``.
Nothing here is a built-in number: every prediction comes from a file someone measured. The file::

    {"format": "tinyconv-devices", "version": 1,
     "devices": [{"name": "host1-numpy", "host": "host1", "backend": "numpy", "threads": 1,
                  "measured": "2025-...", "arch": "300:1000", "norm": "lrn", "batch": 64,
                  "solo_step_s": 5.1,       # a whole training step of the master alone
                  "fuse": {"off": {"comp_s": 0.9, "layers": [
                                     {"name": "conv1", "kernels": 300, "fixed_s": 0.01,
                                      "per_kernel_s": 0.0009, "in_step_s": 0.28, "samples": [[18, 0.03], ...]}, ...]},
                           "on":  {...}}}],
     "links": {"loopback": {"bandwidth_MBps": 2100.0, "latency_ms": 0.05}}}

Per layer, ``fixed_s`` + ``per_kernel_s`` * k is the forward + backward of k kernels of that layer
(``tinyconv/distributed/cost.py``'s affine model): with ``fuse`` "off" the convolution alone (the paper's
split), with "on" the convolution and its ReLU / LRN / batch norm / pool tail (tinyconv's). Its shape (fixed vs
per kernel) is fitted by :func:`fit_line`, ordinary least squares, to ``calibrate.time_block``
timings at a few k; its height comes from the same layer timed within the master alone's steps
(``in_step_s``, at k = F), and ``comp_s`` is the rest of those steps -- the other layers, the loss,
the update. So a prediction for one participant gives back ``solo_step_s`` (up to medians of parts
against the median of the whole), however far apart in time, and load, the layers and the step were
timed: on this shared machine conv2 alone took 9.4 s in one measurement and 17.8 s in the next.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT, VERSION = "tinyconv-devices", 1


@dataclass(frozen=True)
class LayerCost:
    """One device's forward + backward time on one conv layer: t(k) = fixed_s + per_kernel_s * k."""

    name: str
    kernels: int  # F, the layer's kernels
    fixed_s: float
    per_kernel_s: float

    def time(self, k: int) -> float:
        return 0.0 if k <= 0 else self.fixed_s + self.per_kernel_s * k


@dataclass(frozen=True)
class SplitCost:
    """One device's costs with the tails fused or not: its conv layers, and the master's rest of a step."""

    comp_s: float
    layers: tuple[LayerCost, ...]


@dataclass(frozen=True)
class Device:
    """One measured device at one arch, norm and batch."""

    name: str
    arch: str
    norm: str
    batch: int
    solo_step_s: float
    fuse: dict[str, SplitCost]  # "off", "on"
    cores: float | None = None  # the CPU quota it was measured in (tinyconv/lab/experiment/cpu_quota.py), or none


def slowed(d: Device, factor: float) -> Device:
    """``d`` with every time ``factor`` times longer: a device ``factor`` times slower (the paper's 2017
    CPUs ran Matlab), for asking where its link would have stopped paying."""

    def scale(s: SplitCost) -> SplitCost:
        layers = tuple(LayerCost(c.name, c.kernels, c.fixed_s * factor, c.per_kernel_s * factor) for c in s.layers)
        return SplitCost(s.comp_s * factor, layers)

    fuse = {k: scale(s) for k, s in d.fuse.items()}
    return Device(d.name, d.arch, d.norm, d.batch, d.solo_step_s * factor, fuse, d.cores)


def load(path: str | Path) -> tuple[list[Device], dict[str, dict[str, float]]]:
    """The devices and the measured links of a device file; a ValueError naming what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read device file {path}: {e}") from None
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("version") == VERSION):
        raise ValueError(
            f"{path} is not a {FORMAT} file of version {VERSION} (make one with --measure --device-file FILE)"
        )
    try:
        devices = [_device(d) for d in doc["devices"]]
        links = {
            name: {"bandwidth_MBps": float(v["bandwidth_MBps"]), "latency_ms": float(v["latency_ms"])}
            for name, v in doc.get("links", {}).items()
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed device entry ({type(e).__name__}: {e})") from None
    return devices, links


def _device(d: dict[str, Any]) -> Device:
    fuse = {}
    for key in ("off", "on"):
        s = d["fuse"][key]
        layers = tuple(
            LayerCost(x["name"], int(x["kernels"]), float(x["fixed_s"]), float(x["per_kernel_s"])) for x in s["layers"]
        )
        if not all(c.fixed_s >= 0 and c.per_kernel_s > 0 and c.kernels > 0 for c in layers):
            raise ValueError(f"device {d['name']!r}: a layer needs kernels > 0, fixed_s >= 0, per_kernel_s > 0")
        fuse[key] = SplitCost(max(0.0, float(s["comp_s"])), layers)
    solo = float(d["solo_step_s"])
    if not (math.isfinite(solo) and solo > 0):
        raise ValueError(f"device {d['name']!r}: solo_step_s must be > 0")
    cores = d.get("cores")
    if cores is not None and not (isinstance(cores, (int, float)) and cores > 0):
        raise ValueError(f"device {d['name']!r}: cores must be a CPU quota > 0 or absent, got {cores!r}")
    return Device(str(d["name"]), str(d["arch"]), str(d["norm"]), int(d["batch"]), solo, fuse, cores)


def save(path: str | Path, entry: dict[str, Any], links: dict[str, dict[str, float]]) -> None:
    """Add ``entry`` (a measured device) and ``links`` to the file at ``path`` (made if missing),
    replacing an entry of the same name, arch, norm, batch and CPU quota and a link of the same name."""
    path = Path(path)
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "devices": [], "links": {}}
    if path.exists():
        load(path)  # refuse to overwrite something that is not a device file
        doc = json.loads(path.read_text())
    key = ("name", "arch", "norm", "batch", "cores")
    doc["devices"] = [d for d in doc["devices"] if any(d.get(k) != entry.get(k) for k in key)] + [entry]
    doc.setdefault("links", {}).update(links)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def fit_line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of t = a + b k through (k, t) samples by ordinary least squares, with a >= 0 (else the
    line through the origin) and b > 0.

    Not ``cost.fit_affine_cost``: the rebalancer takes the steepest slope the noise allows (the safe
    side for moving kernels), which from four samples is nearly always the proportional model, a = 0
    -- and the fixed part (every participant's im2col of the whole input) is what decides how far
    the split scales. Here the samples are deliberate and few, so the plain fit is the honest one."""
    n = len(samples)
    k_bar, t_bar = sum(k for k, _ in samples) / n, sum(t for _, t in samples) / n
    s_kk = sum((k - k_bar) ** 2 for k, _ in samples)
    b = sum((k - k_bar) * (t - t_bar) for k, t in samples) / s_kk if s_kk > 0 else 0.0
    a = t_bar - b * k_bar
    if a < 0 or b <= 0:  # through the origin: t = b k
        a, b = 0.0, sum(k * t for k, t in samples) / sum(k * k for k, _ in samples)
    return a, b


def _samples(kernels: int) -> list[int]:
    """The kernel counts a layer is timed at: a few fractions of it, the whole layer last (the affine
    fit passes through the newest point: the whole layer, what eq. 1 weighs devices by)."""
    return sorted({max(1, kernels // 16), max(1, kernels // 4), max(1, kernels // 2)} - {kernels}) + [kernels]


def measure_device(
    arch: str, batch: int, norm: str, repeats: int, name: str, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """Time this machine (numpy backend, whatever BLAS threads the process has) and return its entry:
    each conv layer at a few k (``calibrate.time_block``), fitted (:func:`fit_line`), with and
    without its tail, and the master alone's whole training step (median of ``repeats``)."""
    from tinyconv.distributed.calibrate import Spec, time_block
    from tinyconv.distributed.conv_shapes import conv_shapes
    from tinyconv.lab.experiment.cpu_quota import own_cores
    from tinyconv.layers import Conv2D
    from tinyconv.model import paper_net

    net = paper_net(arch, "numpy", norm, seed=0)
    convs = conv_shapes(net, batch)
    layers = [layer for layer in net.layers if isinstance(layer, Conv2D)]
    solo, comp, in_step = _solo_step(net, batch, repeats)
    say(f"master alone: {solo:.3f} s a step, of which comp {comp['off']:.3f} s (tails fused: {comp['on']:.3f} s)")
    entry: dict[str, Any] = {
        "name": name,
        "host": socket.gethostname(),
        "backend": "numpy",
        "measured": datetime.datetime.now().isoformat(timespec="seconds"),
        "cores": own_cores(),
        "arch": arch,
        "norm": norm,
        "batch": batch,
        "solo_step_s": solo,
        "fuse": {},
    }
    for fuse in ("off", "on"):
        costs = []
        for i, (conv, layer) in enumerate(zip(convs, layers, strict=True)):
            tail = list(conv.tail) if fuse == "on" else []
            samples = []
            for k in _samples(conv.w[0]):
                spec = Spec(i, conv.x, (k, *conv.w[1:]), layer.stride, layer.padding, conv.need_dx, tail)
                samples.append((k, time_block(net.backend, spec, repeats)))
            fixed, per = fit_line(samples)
            level = in_step[fuse][i] / (fixed + per * conv.w[0])  # the line's height: the layer within a step
            fixed, per = fixed * level, per * level
            say(
                f"fuse {fuse} {conv.name}: {fixed:.4f} s + {per * 1e3:.4f} ms per kernel (all {conv.w[0]}: "
                f"{in_step[fuse][i]:.3f} s within a step, {samples[-1][1]:.3f} s alone)"
            )
            costs.append(
                {
                    "name": conv.name,
                    "kernels": conv.w[0],
                    "fixed_s": fixed,
                    "per_kernel_s": per,
                    "in_step_s": in_step[fuse][i],
                    "samples": [[k, t] for k, t in samples],
                }
            )
        entry["fuse"][fuse] = {"comp_s": comp[fuse], "layers": costs}
    return entry


def _solo_step(net: Any, batch: int, repeats: int) -> tuple[float, dict[str, float], dict[str, list[float]]]:
    """A training step of ``net`` alone (forward, loss, backward, SGD), each run of layers
    (``Network.runs``) timed on its own, medians of ``repeats`` after a warm-up: (the step, its comp
    with the tails fused or not {"off": s, "on": s}, each conv layer's time {"off": [conv l],
    "on": [conv l and its tail]})."""
    import numpy as np

    from tinyconv.distributed.shard.layer import tail_of
    from tinyconv.layers import Conv2D, relu_lrn_forward
    from tinyconv.optim import SGD

    be, owner = net.backend, {}  # layer -> ("conv" or "tail", its conv's ordinal)
    for i, layer in enumerate(net.layers):
        if isinstance(layer, Conv2D):
            l = sum(isinstance(m, Conv2D) for m in net.layers[:i])
            owner[id(layer)] = ("conv", l)
            owner.update({id(t): ("tail", l) for t in net.layers[i + 1 : i + 1 + len(tail_of(net.layers[i + 1 :]))]})
    rng = np.random.default_rng(0)
    x = be.asarray(rng.standard_normal((batch, 3, 32, 32), dtype=np.float32))
    y = rng.integers(0, 10, batch)
    opt = SGD(net, 0.001, momentum=0.9, weight_decay=5e-4)

    def timed(run: tuple, f: Callable[[], Any], spent: dict[tuple[str, int], float]) -> Any:
        t = time.perf_counter()
        out = f()
        be.synchronize()
        if id(run[0]) in owner:
            spent[owner[id(run[0])]] = spent.get(owner[id(run[0])], 0.0) + time.perf_counter() - t
        return out

    def once() -> tuple[float, dict[tuple[str, int], float]]:
        spent: dict[tuple[str, int], float] = {}
        t0, a = time.perf_counter(), x
        for run in net.runs():  # as Network.forward runs them: a ReLU + LRN as one op
            a = timed(run, lambda r=run, a=a: relu_lrn_forward(*r, a) if len(r) == 2 else r[0].forward(a, True), spent)
        _, d = net.loss_fn(a, y)
        for layer in reversed(net.layers):  # as Network.backward: layer by layer
            d = timed((layer,), lambda m=layer, d=d: m.backward(d), spent)
            if d is None:
                break
        opt.step()
        be.synchronize()
        return time.perf_counter() - t0, spent

    once()
    steps = [once() for _ in range(repeats)]
    n = len({l for _, l in owner.values()})
    layers = {"off": [[s.get(("conv", l), 0.0) for _, s in steps] for l in range(n)]}
    layers["on"] = [[s.get(("conv", l), 0.0) + s.get(("tail", l), 0.0) for _, s in steps] for l in range(n)]
    comp = {k: statistics.median(t - sum(v[j] for v in layers[k]) for j, (t, _) in enumerate(steps)) for k in layers}
    return statistics.median(t for t, _ in steps), comp, {k: [statistics.median(v) for v in layers[k]] for k in layers}


def measure_loopback(frame_mb: float = 16.0, frames: int = 8, pings: int = 50) -> dict[str, float]:
    """This machine's ZeroMQ loopback link: TCP on 127.0.0.1 between two threads (libzmq moves the
    bytes on its own I/O threads, as between two processes). Latency: half the median round trip of a
    1-byte message; bandwidth: ``frames`` frames of ``frame_mb`` MB one way, until the receiver's ack."""
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            a.send(b"x")
            b.send(b.recv())
            a.recv()
            rtts.append(time.perf_counter() - t)
        payload = bytes(int(frame_mb * 1e6))

        def receive() -> None:
            for _ in range(frames):
                b.recv(copy=False)
            b.send(b"done")

        receiver = threading.Thread(target=receive)
        t = time.perf_counter()
        receiver.start()
        for _ in range(frames):
            a.send(payload, copy=False)
        a.recv()
        seconds = time.perf_counter() - t
        receiver.join()
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
    return {"bandwidth_MBps": frames * len(payload) / seconds / 1e6, "latency_ms": statistics.median(rtts) / 2 * 1e3}
