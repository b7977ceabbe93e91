"""What a worker keeps between tasks (:class:`WorkerState`, which every task handler gets), and the checks of a
task's spans and tail that the handlers share.

For each layer whose step is under way it keeps an :class:`OpenStep`, what the layer's forward left for the rest
of its step, in a slot per layer (or the hybrid's one slot, :data:`HYBRID`). Which task may come next is one row
per task kind (:data:`STAGES`), and a task that continues a layer must be of its forward's step. A refused task
changes nothing, so the right one can follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import Backend, conv_output_size
from tinyconv.distributed.protocol import NORM_INPUTS, TaskError
from tinyconv.distributed.shard.block import BlockCache, tail_output_hw
from tinyconv.model import Network
from transports.wire import Int, Num

HYBRID = "conv part"  # the slot the hybrid's forward is kept in: the whole conv part, not one layer

# task kind -> (the stage the layer must be at, None: anything; the stage it leaves, None: nothing kept)
STAGES: dict[str, tuple[str | None, str | None]] = {
    "block_forward": (None, "block"),  # the block's cache (split by kernels)
    "block_backward": ("block", None),
    "partial_forward": (None, "partial"),  # its partial convolution (split by input channels)
    "tail_forward": ("partial", "tail"),  # the tail's cache
    "tail_backward": ("tail", "dyc"),  # its kernels' conv-output gradient
    "partial_backward": ("dyc", None),
    "hybrid_forward": (None, "hybrid"),  # the conv part's caches, in the one slot of the whole conv part
    "hybrid_backward": ("hybrid", None),
}
_LEFT_BY = {leaves: kind for kind, (_, leaves) in STAGES.items() if leaves}


@dataclass
class OpenStep:
    """What one layer's forward left on this worker for the rest of its step."""

    stage: str
    step: int
    cache: BlockCache | None = None  # "block": the block's cache
    tails: list[BlockCache] = field(default_factory=list)  # "tail", "dyc": the tail's caches, one per tail chunk
    conv: Any = None  # "partial" on: the backend's cache of the partial convolution
    partial: list[np.ndarray | None] = field(default_factory=list)  # "partial": per chunk, the partial
    #                                        convolution on the computed kernels (F', n, OH, OW), until summed
    summed: np.ndarray | None = None  # "partial": (N, F', OH, OW), the sums tail_forward has added so far
    tail: list[dict[str, Any]] = field(default_factory=list)
    own: tuple[int, int] = (0, 0)  # the own kernels, as offsets into the computed ones
    dyc: np.ndarray | None = None  # "dyc": all of dY_conv (F, N, OH, OW), its own rows from tail_backward,
    #                                the others' from partial_backward
    kernels: int = 0  # all F kernels of a layer split by input channels
    w: Any = None  # "partial": its weights on the backend, for the chunks after the first
    b: np.ndarray | None = None  # "partial": the bias over its halo, and a batch norm's arrays, from the first
    norm: dict[str, np.ndarray] = field(default_factory=dict)  # tail_forward on
    settings: list[Any] = field(default_factory=list)  # "partial": the first chunk's, which the others repeat
    halo: tuple[int, int] = (0, 0)  # "partial": the computed kernels [cs, ce) of F
    probe: Any = None  # what a probe's sums read (replica/probe.py): "hybrid", the forward's probe and each
    #                    convolution's input, if asked; "block", its input x, stride, padding and w's (C, K, K)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # the image ranges of its partial_forwards
    done: int = 0  # chunks through tail_forward, then through tail_backward, then through partial_backward
    dw: np.ndarray | None = None  # partial_backward's sums over the chunks so far
    db: np.ndarray | None = None
    images: int = 0  # "hybrid": the slice's images
    features: tuple[int, int, int] = (0, 0, 0)  # "hybrid": (C2, H', W') of one image


@dataclass
class WorkerState:
    """A worker's backend and settings (``handler.Worker``'s), and what it keeps between tasks."""

    backend: Backend
    slowdown: float
    max_calibrate_bytes: int
    open: dict[int | str, OpenStep] = field(default_factory=dict)  # slot -> its layer's open step
    replica: tuple[str, Network] | None = None  # data parallelism: (its description, the network)

    def forget(self) -> None:
        """A new session: nothing kept from an earlier one."""
        self.open.clear()
        self.replica = None

    def expect(self, kind: str, h: dict[str, Any]) -> OpenStep | None:
        """The layer's open step, if a ``kind`` task continues one; a TaskError if it cannot."""
        if kind not in STAGES or STAGES[kind][0] is None:
            return None
        where, needs = task_place(h), STAGES[kind][0]
        kept = self.open.get(task_slot(h))
        if kept is None:
            raise TaskError(
                f"{where}: nothing kept of this layer's forward: send {_LEFT_BY[needs]} first "
                "(or again, if this worker was restarted)"
            )
        if kept.step != h["step"]:
            whose = "this layer's" if isinstance(task_slot(h), int) else "the conv part's"
            raise TaskError(f"{where}: {whose} kept forward is of step {kept.step}")
        if kept.stage != needs:
            raise TaskError(
                f"{where}: {kind} follows {_LEFT_BY[needs]}, but this layer's last task was {_LEFT_BY[kept.stage]}"
            )
        return kept

    def advance(self, h: dict[str, Any], kind: str, kept: OpenStep) -> None:
        """The layer moves on to the stage ``kind`` leaves it at (forgotten at the end of its step)."""
        leaves = STAGES[kind][1]
        if leaves is None:
            del self.open[task_slot(h)]  # one backward per forward; frees what it kept
        else:
            kept.stage = leaves
            self.open[task_slot(h)] = kept


# a task handler: (the worker's state, the task's header, its arrays, the layer's open step if the task
# continues one) -> its result's arrays (and "times", for a calibration)
Handler = Callable[[WorkerState, dict[str, Any], dict[str, Any], OpenStep | None], dict[str, Any]]


def task_slot(h: dict[str, Any]) -> int | str:
    """Where a task's open step lives: its layer's index, or the hybrid's one slot."""
    return h.get("layer", HYBRID)


def task_place(h: dict[str, Any]) -> str:
    """The task's place in a step, for errors: "layer 1 step 3", "the conv part step 3"."""
    slot = task_slot(h)
    return f"{'layer ' if isinstance(slot, int) else 'the '}{slot} step {h['step']}"


def header_span(h: dict[str, Any], key: str, limit: int) -> tuple[int, int]:
    """Header ``key``, a non-empty range [a, b] with 0 <= a < b <= limit, as a tuple."""
    v = h[key]
    if not (isinstance(v, list) and len(v) == 2 and all(Int.accepts(i) for i in v) and 0 <= v[0] < v[1] <= limit):
        raise TaskError(f"layer {h['layer']}: {key} must be [a, b] with 0 <= a < b <= {limit}, got {v!r}")
    return v[0], v[1]


def checked_tail(h: dict[str, Any], size: tuple[int, ...], kernel: tuple[int, ...]) -> list[dict[str, Any]]:
    """The task's tail, checked against the convolution's output size."""
    if h["stride"] < 1 or h["padding"] < 0:
        raise TaskError(f"layer {h['layer']}: need stride >= 1 and padding >= 0, got {h['stride']} and {h['padding']}")
    try:
        oh, ow = (conv_output_size(s, k, h["stride"], h["padding"]) for s, k in zip(size, kernel, strict=True))
        tail_output_hw(oh, ow, check_tail(h["tail"]))
    except ValueError as e:
        raise TaskError(f"layer {h['layer']}: {e}") from None
    return h["tail"]


TAIL_OPS = {  # op -> its parameters and their types
    "relu": {},
    "lrn": {"size": int, "alpha": float, "beta": float, "k": float},
    "bn": {"eps": float, "training": bool},
    "maxpool": {"kernel": int, "stride": int, "padding": int},
}


def check_tail(tail: Any) -> list[dict[str, Any]]:
    """Raise ValueError unless ``tail`` is a list of valid specs; returns it."""
    if not isinstance(tail, list):
        raise ValueError(f"tail must be a list of layer specs, got {type(tail).__name__}")
    for i, spec in enumerate(tail):
        if not isinstance(spec, dict) or spec.get("op") not in TAIL_OPS:
            raise ValueError(f"tail[{i}] must be a map with op one of {sorted(TAIL_OPS)}, got {spec!r:.200}")
        params = TAIL_OPS[spec["op"]]
        if set(spec) != {"op", *params}:
            raise ValueError(f"tail[{i}] ({spec['op']}) needs exactly the keys {sorted(params)}, got {sorted(spec)}")
        for key, kind in params.items():
            v, accepts = spec[key], {int: Int.accepts, float: Num.accepts, bool: lambda v: isinstance(v, bool)}[kind]
            if not accepts(v):
                raise ValueError(f"tail[{i}].{key} must be a{'n' if kind is int else ''} {kind.__name__}, got {v!r}")
        if spec["op"] == "lrn" and not (1 <= spec["size"] <= 64 and spec["k"] > 0 and spec["beta"] >= 0):
            raise ValueError(f"tail[{i}]: lrn needs 1 <= size <= 64, k > 0, beta >= 0, got {spec}")
        if spec["op"] == "maxpool" and not (
            spec["kernel"] >= 1 and spec["stride"] >= 1 and 0 <= spec["padding"] < spec["kernel"]
        ):
            raise ValueError(f"tail[{i}]: maxpool needs kernel >= 1, stride >= 1, 0 <= padding < kernel, got {spec}")
        if spec["op"] == "bn" and not spec["eps"] > 0:
            raise ValueError(f"tail[{i}]: bn needs eps > 0, got {spec}")
    if sum(spec["op"] == "bn" for spec in tail) > 1:
        raise ValueError("a tail holds one bn at most")
    return tail


def norm_arrays(tail: list[dict[str, Any]], a: dict[str, Any], kernels: int, where: str) -> dict[str, Any]:
    """The task's batch-norm arrays (``block.py``): gamma and beta of its ``kernels`` when its tail has a bn,
    mean and var too outside training; a TaskError if they do not fit."""
    bn = next((spec for spec in tail if spec["op"] == "bn"), None)
    need = set() if bn is None else {"gamma", "beta"} | (set() if bn["training"] else {"running_mean", "running_var"})
    got = {k: a[k] for k in NORM_INPUTS if k in a}
    if set(got) != need or any(tuple(v.shape) != (kernels,) for v in got.values()):
        shapes = {k: tuple(v.shape) for k, v in got.items()}
        raise TaskError(f"{where}: its tail needs exactly {sorted(need) or 'no'} arrays ({kernels},), got {shapes}")
    return dict(got)
