"""A plan: which kernels (and which input channels) of one layer each participant computes.

Pure data, built from counts. A *participant* is anyone who computes: the master, if it
takes part, and each worker, always in that order. With F = 7 kernels and the
counts [3, 0, 4] for master, worker0, worker1::

    master   kernels [0, 3)                    worker0  kernels [3, 3): nothing this step
    worker1  kernels [3, 7)

A participant *owns* its kernels: it returns their output channels and their rows of
dW and db. With a tail after the convolution (ReLU, LRN, batch norm, max pool: ``block.py``) it
also computes a *halo*, a few neighbouring kernels that LRN's window reads; for LRN
of size 5 that is 4 on each side, clipped to [0, F): master [0, 7), worker1 [0, 7) here.

A layer split by input channels (``by_channels.py``) also gives each participant a
contiguous range of the layer's C input channels, > 0 exactly where it has kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinyconv.distributed.shard.balance import slices
from tinyconv.distributed.shard.block import halo_span


@dataclass(frozen=True)
class Participant:
    """One participant's share of one layer. Spans are slices, so ``w[p.kernels]`` is its rows."""

    name: str  # "master", "worker0", ...
    worker: int | None  # its index on the transport; None for the master
    kernels: slice  # the kernels it owns: rows of w and b, channels of the output
    halo: slice  # the kernels it computes: its own, widened by the tail's halo
    channels: slice | None = None  # its input channels, for a layer split by them

    @property
    def n_kernels(self) -> int:
        return self.kernels.stop - self.kernels.start

    @property
    def own(self) -> tuple[int, int]:
        """Its kernels as offsets into the ones it computes."""
        return self.kernels.start - self.halo.start, self.kernels.stop - self.halo.start


@dataclass(frozen=True)
class Plan:
    """Every participant's share of one layer of F kernels, in participant order."""

    participants: tuple[Participant, ...]

    @staticmethod
    def of(
        placement: Sequence[tuple[str, int | None]],
        counts: Sequence[int],
        tail: list[dict[str, Any]],
        channel_counts: Sequence[int] | None = None,
    ) -> Plan:
        """The plan giving ``counts[i]`` kernels (and ``channel_counts[i]`` input channels) to
        ``placement[i]`` = (name, worker index or None), in order; ``tail`` sets the halo."""
        total = sum(counts)
        channels = slices(channel_counts) if channel_counts is not None else [None] * len(counts)
        return Plan(
            tuple(
                Participant(name, worker, slice(s, e), halo_span(s, e, total, tail), None if c is None else slice(*c))
                for (name, worker), (s, e), c in zip(placement, slices(counts), channels, strict=True)
            )
        )

    @property
    def counts(self) -> list[int]:
        """Kernels per participant."""
        return [p.n_kernels for p in self.participants]

    @property
    def channel_counts(self) -> list[int] | None:
        """Input channels per participant, for a layer split by them; else None."""
        if self.participants[0].channels is None:
            return None
        return [p.channels.stop - p.channels.start for p in self.participants]

    @property
    def active(self) -> list[Participant]:
        """The participants with kernels this step."""
        return [p for p in self.participants if p.n_kernels > 0]

    @property
    def master(self) -> Participant | None:
        """The master, if it has kernels this step."""
        return next((p for p in self.active if p.worker is None), None)

    @property
    def workers(self) -> list[Participant]:
        """The workers with kernels this step."""
        return [p for p in self.active if p.worker is not None]
