"""A tail's batch norm across a split (``block.py`` runs it on each participant's kernels).

Batch norm's statistics are each kernel's, over the batch and the pixels, so they split by kernels as
ReLU does. Participant i computes kernels h_i (its own k_i and their halo)::

    forward   gets gamma[h_i], beta[h_i] (outside training, the running mean[h_i] and var[h_i] it normalises by)
              gives, with y[:, k_i], its batch mean and unbiased variance over h_i; the master folds those of
              every k_i into its running statistics, r <- (1 - momentum) r + momentum * stat, as BatchNorm2D does
    backward  gives dgamma[k_i], dbeta[k_i], beside dw[k_i] and db[k_i]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import Array, Backend
from tinyconv.distributed.rpc import Op
from tinyconv.distributed.shard.plan import Participant
from tinyconv.layers import BatchNorm2D, Layer


def norm_of(layers: list[Layer]) -> BatchNorm2D | None:
    """The batch norm of a tail's layers, if it has one."""
    return next((layer for layer in layers if isinstance(layer, BatchNorm2D)), None)


@dataclass(frozen=True)
class SplitNorm:
    """A sharded block's batch norm in one forward: ``layer`` (None: its tail has none), in ``training`` or not."""

    layer: BatchNorm2D | None = None
    training: bool = False

    @property
    def grads(self) -> tuple[str, ...]:
        """The parameters whose gradients come back with the backward's."""
        return () if self.layer is None else ("gamma", "beta")

    def inputs(self, kernels: slice) -> dict[str, np.ndarray]:
        """What a participant that computes ``kernels`` gets of it, host arrays: gamma and beta, and outside
        training the running statistics (mean, var)."""
        if self.layer is None:
            return {}
        named = {"gamma": self.layer.params["gamma"], "beta": self.layer.params["beta"]}
        if not self.training:
            named |= self.layer.buffers  # running_mean, running_var
        return {k: np.ascontiguousarray(self.layer.backend.to_numpy(a)[kernels]) for k, a in named.items()}

    def local(self, be: Backend, kernels: slice) -> dict[str, Array]:
        """The master's own :meth:`inputs`, on its backend (its forward puts its batch statistics in)."""
        return {k: be.asarray(a) for k, a in self.inputs(kernels).items()}

    def fold(self, op: Op, active: list[Participant], results: dict[int, Any], mine: dict[str, Array]) -> None:
        """After a training forward: every participant's batch statistics of its own kernels, in order (the master's
        in ``mine``, a worker's in its result), into the running statistics."""
        if self.layer is None or not self.training:
            return
        stats = [self._own(op, p, mine if p.worker is None else results[p.worker]) for p in active]
        m = np.float32(self.layer.momentum)
        for name, parts in zip(("running_mean", "running_var"), zip(*stats, strict=True), strict=True):
            r = self.layer.backend.to_numpy(self.layer.buffers[name]) * (np.float32(1) - m)
            self.layer.buffers[name] = self.layer.backend.asarray(r + m * np.concatenate(parts))

    @staticmethod
    def _own(op: Op, p: Participant, got: Any) -> tuple[np.ndarray, ...]:
        """Participant p's batch mean and variance of its own kernels, from those of all it computed."""
        lo, hi = p.own
        if p.worker is None:
            return tuple(op.backend.to_numpy(got[k])[lo:hi] for k in ("mean", "var"))
        return tuple(op.array(p.worker, got, k, (p.halo.stop - p.halo.start,))[lo:hi] for k in ("mean", "var"))


def joined_grads(
    op: Op, active: list[Participant], names: tuple[str, ...], mine: dict[str, Array], replies: dict
) -> dict:
    """{"gamma": dgamma (F,), "beta": dbeta (F,)} for ``names`` (SplitNorm.grads): every participant's of its own
    kernels, in order; the master's in ``mine`` (its BlockCache.dnorm), a worker's in its reply."""
    be = op.backend

    def part(p: Participant, name: str) -> np.ndarray:
        if p.worker is None:
            return be.to_numpy(mine[name])
        return op.array(p.worker, replies[p.worker], "d" + name, (p.n_kernels,))

    return {name: be.asarray(np.concatenate([part(p, name) for p in active])) for name in names}
