"""What the trainer asks of a parallel runtime, whatever it splits (kernels, or the batch among replicas):
:class:`Parallel`. Without one the trainer runs the same step on the master alone (:func:`forward_backward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from backends.base import Array
from tinyconv.model import Network


class Parallel(Protocol):
    """A runtime sharing the training step with workers (``tinyconv.distribute`` returns one).

    ``splits``: what its plans count, "kernels" or "images"; ``counts``: unit (a layer, or
    "batch") -> its count per participant, ``channel_counts`` the input channels of the layers
    split by them; ``participants``: "master" (if it takes part), "worker0", ... in plan order;
    ``step``: finished steps, which a resumed run sets; ``last_step``: the finished step's record,
    with at least comm_s, conv_s, bytes_sent, bytes_recv, shares (the metrics' step fields) and, for
    the summary, participants, participant_bytes_sent and participant_bytes_recv
    (``tinyconv/report.py``)."""

    splits: str
    counts: dict[str, list[int]]
    channel_counts: dict[str, list[int]]
    step: int
    last_step: dict[str, Any] | None

    @property
    def participants(self) -> list[str]: ...

    def train_batch(
        self, net: Network, x: Array | np.ndarray, y: np.ndarray, smoothing: float = 0.0
    ) -> tuple[float, Array]:
        """Forward, loss (label-smoothed by ``smoothing``) and backward of the batch x (N, C, H, W),
        y (N,): every grad of ``net`` filled, no parameter changed -> (mean loss, logits (N, classes))."""
        ...

    def set_plan(self, layer: str, counts: Sequence[int], channels: Sequence[int] | None = None) -> None: ...

    def pop_events(self) -> list[dict[str, Any]]:
        """What happened since the last call (workers lost, joined), each with an "event" key."""
        ...

    def close(self) -> None: ...


def forward_backward(net: Network, x: Array | np.ndarray, y: np.ndarray, smoothing: float = 0.0) -> tuple[float, Array]:
    """:meth:`Parallel.train_batch` on the master alone. A loss that is not finite returns before the
    backward, which would only spread it."""
    logits = net.forward(net.backend.asarray(x), training=True)
    loss, dlogits = net.training_loss(smoothing)(logits, y)  # (tests may swap loss_fn)
    if np.isfinite(loss):
        net.backward(dlogits)
    return loss, logits
