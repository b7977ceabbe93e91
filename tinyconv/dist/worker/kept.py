"""What a worker keeps of one layer's step between its tasks, and where: :class:`Kept`, in a slot per
layer (or the hybrid's one slot), and the checks of a task's place in a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tinyconv.dist.shard.block import BlockCache
from tinyconv.dist.protocol import TaskError
from transports.wire import Int

HYBRID = "conv part"  # the slot the hybrid's forward is kept in: the whole conv part, not one layer


@dataclass
class Kept:
    """What one layer's forward left on this worker for the rest of its step."""

    stage: str
    step: int
    cache: BlockCache | None = None  # "block", "tail", "dyc": the block's (or the tail's) cache
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
    settings: list[Any] = field(default_factory=list)  # "partial": the first chunk's, which the others repeat
    halo: tuple[int, int] = (0, 0)  # "partial": the computed kernels [cs, ce) of F
    chunks: list[tuple[int, int]] = field(default_factory=list)  # the image ranges of its partial_forwards
    done: int = 0  # images summed by tail_forward; then chunks through partial_backward
    dw: np.ndarray | None = None  # partial_backward's sums over the chunks so far
    db: np.ndarray | None = None
    images: int = 0  # "hybrid": the slice's images
    features: tuple[int, int, int] = (0, 0, 0)  # "hybrid": (C2, H', W') of one image


def task_slot(h: dict[str, Any]) -> int | str:
    """Where a task's kept forward lives: its layer's index, or the hybrid's one slot."""
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
