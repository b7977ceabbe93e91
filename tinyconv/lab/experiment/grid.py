"""The grid's cells, the order they run in, what each is expected to cost, and which are done.

**Order.** Repeats are rounds: every configuration runs its repeat 0 before any runs its
repeat 1, so a configuration's repeats are a whole round apart, never back to back. Within a
round the batch changes slowest, then participants / parallel / fuse / split / rebalance /
wire / pipeline / backend / norm, and the architecture fastest: consecutive cells differ in architecture
(when there are several), so a slow drift of the shared machine spreads over all of them
instead of landing on one architecture's cells. Every round runs in the same order. Inside a cell, solo and
distributed steps alternate step by step (``run.py``), so the speedup itself is measured
under the same conditions on both sides.

**Participants 1** (``--workers 0``) is the master alone: nothing is split or fused, so its cell is run once
per (arch, norm, batch, backend, repeat) whatever --fuse, --split and --parallel say, and its
row says ``fuse = split = "-"`` and ``parallel = "model"`` (as rows written before the
column existed read). **Data-parallel** cells (``parallel = "data"``, ``tinyconv/distributed/replica/``)
split the batch, not the convolutions, and so do **hybrid** ones (``parallel = "hybrid"``: the
convolutions by images, the classifier on the master): --fuse and --split mean nothing there,
and their rows say ``"-"`` for both.

**Rebalance and wire.** ``rebalance`` "on" lets the ``Rebalancer`` follow the measured times
during the cell's steps (warm-up included), as the main job does; "off" keeps the split the
calibration chose for every step, so a slow link's steady state with a fixed split is measured
rather than the rebalancer moving kernels while the steps are timed. ``wire`` is the
``--wire-precision`` the shards travel in (``tinyconv/distributed/wire_precision.py``: fp32, adt24,
bf16, fp16, s8, or adaptive). A data-parallel or hybrid cell rebalances its images or not
likewise, but sends float32 only (they refuse narrowing): their cells at any other wire are
left out, not run. The master alone has no rebalancer and sends nothing: its row says
``"-"`` for both, as for fuse and split; a row written before these columns existed reads
"on" and "fp32" (``"-"`` for the master alone).

**Pipeline.** ``pipeline`` is ``Cluster(pipeline=)``: the images per chunk in which a layer split
by input channels goes (``tinyconv/distributed/shard/by_channels.py``; "0": the whole batch at once). A
model-parallel cell runs once per --pipeline value, also when its split turns out to be by
kernels, which has no pipeline: the grid cannot know what ``split="auto"`` will choose. The master
alone and data / hybrid cells split no channels: their rows say ``"-"``, and they run once. A row
written before the column existed reads "0" for a model-parallel cell (the whole batch at once was
all there was) and ``"-"`` for the others.

**Devices.** ``devices`` says what each participant ran on: "-", a core of its own (pinned), or
emulated devices (``--cpu-quota``, ``workers.py``), each a cgroup CPU quota, "0.5/0.5/0.5" for the master
and two workers at half a core each. The master alone of such a grid runs at the master's quota, so a
speedup is always against the same device. A row written before the column existed reads "-".

**Cost.** A cell's expected cost, for the progress bar's estimate of the time left, is its
convolutions' multiply-adds (forward and backward, three GEMMs each) times the steps it runs:
warm-up, timed, settle, calibration. Only the ratios between cells matter: the bar's rate is
measured in these units (smoothing 0: the average since the start), so the estimate is
(cost left) / (cost done per second so far).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

NOT_SPLIT = "-"  # fuse and split of a participants-1 cell: the master alone splits nothing
KEY = ("arch", "norm", "batch", "participants", "fuse", "split", "backend", "parallel", "rebalance", "wire", "pipeline",
       "devices", "repeat", "link")  # fmt: skip
PARALLELS = ("model", "data", "hybrid")
BY_IMAGES = ("data", "hybrid")  # the modes that split the batch, not the convolutions (tinyconv/distributed/replica/)
REBALANCES = ("on", "off")
DATA_WIRE = "fp32"  # the only wire a BY_IMAGES cell runs (tinyconv/distributed/replica/ sends float32)
# tinyconv.distributed.shard.by_channels.PIPELINE, the Cluster's default (not imported: it loads numpy before main() set
# the BLAS threads; tests/test_experiment.py keeps the two equal)
PIPELINE = 32
CALIBRATION_STEPS = 3  # about what calibrating costs, in steps: each participant times each layer 3x


@dataclass(frozen=True)
class Cell:
    """One run of the grid: a configuration and the repeat it is."""

    arch: str
    norm: str
    batch: int
    participants: int
    fuse: str  # "on" / "off", or "-" for the master alone
    split: str  # "auto" / "channels" / "kernels", or "-"
    backend: str
    repeat: int
    parallel: str = "model"  # "model": the paper's split of the convolutions; "data", "hybrid": the batch split
    rebalance: str = "on"  # "on" / "off" (the calibrated split kept), or "-" for the master alone
    wire: str = "fp32"  # the --wire-precision of the shards, or "-" for the master alone
    pipeline: str = str(PIPELINE)  # images per chunk of the channel split ("0": the whole batch), or "-" where
    #                                nothing is split by channels (the master alone, data and hybrid cells)
    devices: str = NOT_SPLIT  # each participant's CPU quota in cores, the master's first ("0.5/0.5"), or "-": none

    def key(self, link: str) -> tuple[str, ...]:
        """The cell's identity as the CSV's key columns hold it (all text), on the link ``link``."""
        return (self.arch, self.norm, str(self.batch), str(self.participants), self.fuse, self.split,
                self.backend, self.parallel, self.rebalance, self.wire, self.pipeline, self.devices,
                str(self.repeat), link)  # fmt: skip

    def label(self) -> str:
        """A short name for lines and the progress bar."""
        if self.participants == 1:
            how = "master alone"
        elif self.parallel in BY_IMAGES:
            how = f"P{self.participants} {self.parallel}-parallel rebalance {self.rebalance}"
        else:
            how = (f"P{self.participants} fuse {self.fuse} split {self.split} rebalance {self.rebalance} "
                   f"wire {self.wire} pipeline {self.pipeline}")  # fmt: skip
        on = f" devices {self.devices}" if self.devices != NOT_SPLIT else ""
        return f"{self.arch} {self.norm} batch {self.batch} {how} {self.backend}{on} #{self.repeat}"


def cells(
    archs: Sequence[str],
    batches: Sequence[int],
    participants: Sequence[int],
    repeats: int,
    norms: Sequence[str] = ("lrn",),
    fuses: Sequence[str] = ("on",),
    splits: Sequence[str] = ("auto",),
    backends: Sequence[str] = ("numpy",),
    parallels: Sequence[str] = ("model",),
    rebalances: Sequence[str] = ("on",),
    wires: Sequence[str] = ("fp32",),
    pipelines: Sequence[int] = (PIPELINE,),
    devices: Sequence[float] = (),
) -> list[Cell]:
    """Every cell of the grid, in the order they run (see the module's docstring), without duplicates.
    Data-parallel and hybrid cells come only at fp32 (``DATA_WIRE``): with any other of ``wires`` they are
    left out. ``pipelines`` (images per chunk, 0 = the whole batch) vary the model-parallel cells only.
    ``devices``: each participant's CPU quota, the master's first; a cell of P participants runs on the first P."""
    out: list[Cell] = []
    seen: set[Cell] = set()
    for repeat, batch in product(range(repeats), batches):
        ways = product(participants, parallels, fuses, splits, rebalances, wires, pipelines, backends, norms)
        for p, parallel, fuse, split, rebalance, wire, pipeline, backend, norm in ways:
            alone, data = p == 1, parallel in BY_IMAGES and p > 1
            if data and wire != DATA_WIRE:
                continue
            how = (NOT_SPLIT, NOT_SPLIT) if alone or data else (fuse, split)
            sharing = (NOT_SPLIT, NOT_SPLIT) if alone else (rebalance, wire)
            chunks = NOT_SPLIT if alone or data else str(pipeline)  # only the model split has channels to chunk
            for arch in archs:
                cell = Cell(arch, norm, batch, p, *how, backend, repeat, "model" if alone else parallel, *sharing,
                            chunks, devices_text(devices[:p]))  # fmt: skip
                if cell not in seen:
                    seen.add(cell)
                    out.append(cell)
    return out


def devices_text(quotas: Sequence[float]) -> str:
    """(1.0, 0.5, 0.25) -> "1/0.5/0.25": the participants' CPU quotas in cores, as a row says them; () -> "-"."""
    return "/".join(f"{q:g}" for q in quotas) if quotas else NOT_SPLIT


def cost(cell: Cell, c1: int, c2: int, steps: int, warmup: int, settle: int) -> float:
    """The cell's expected cost in Gflop-ish units: conv multiply-adds per step times its steps."""
    # conv1: 3 -> c1 at 32x32, conv2: c1 -> c2 at 16x16 (after a pool), 5x5 kernels; x3 for fwd + 2 bwd GEMMs
    per_image = 3 * 25 * (32 * 32 * 3 * c1 + 16 * 16 * c1 * c2)
    if cell.participants == 1:
        n_steps = warmup + steps + 1  # + one layer-by-layer step
    else:  # calibration, warm-up, then solo and distributed alternated, each with its settle steps
        n_steps = CALIBRATION_STEPS + warmup + 2 * steps * (1 + settle) + 1
    return cell.batch * per_image * n_steps / 1e9


def pending(grid: Sequence[Cell], done: set[tuple[str, ...]], link: str) -> list[Cell]:
    """The cells of ``grid`` whose key is not among ``done`` (the CSV's keys), in order."""
    return [c for c in grid if c.key(link) not in done]
