"""Who takes part in a step, and what happens when a worker is lost: one rule for every mode.

The model-parallel cluster (``cluster.py``: kernels and input channels) and the data-parallel and
hybrid splits of the batch (``tinyconv/dist/replica/batch.py``: images) seat the same way -- a list of
``(name, worker index)`` seats, the master's index ``None`` -- and lose a worker the same way: it
leaves the seats for good, its share goes to the others by eq. 1 on their calibrated times
(``_replan``, each mode's own), and a ``worker_lost`` event records the shares after. The master
holds every weight, so however many are lost it can always finish the step alone.
"""

from __future__ import annotations

import logging
from typing import Any

from tinyconv.dist.rpc import Rpc
from transports.base import WorkerInfo

log = logging.getLogger(__name__)


class Membership:
    """Seats and losses. A subclass sets ``rpc``, ``seats``, ``workers``, ``lost``, ``events``,
    ``step`` and ``counts`` (unit name -> count per seat), and defines ``_replan()``."""

    rpc: Rpc
    seats: list[tuple[str, int | None]]
    workers: list[WorkerInfo]
    lost: dict[int, str]
    events: list[dict[str, Any]]
    step: int
    counts: dict[str, list[int]]
    gives_away = "its share goes"  # the log's words for where a lost worker's work goes

    def lose(self, workers: dict[int, str]) -> None:
        """``workers`` (index -> why) are no longer participants: their shares go to the others."""
        for k, why in workers.items():
            if k in self.lost:
                continue
            self.lost[k] = why
            log.warning("%s lost: %s; %s to the others", self.rpc.describe(k), why, self.gives_away)
            self.seats = [seat for seat in self.seats if seat[1] != k]
            self.workers = [w for w in self.workers if w.index != k]
            if not self.seats:  # the master holds every weight: it can always finish alone
                self.seats = [("master", None)]
            self._replan()  # type: ignore[attr-defined]  # each mode shares its own units out again
            self.events.append({"event": "worker_lost", "step": self.step, "worker": f"worker{k}", "reason": why,
                                "shares": {name: list(c) for name, c in self.counts.items()}})  # fmt: skip
