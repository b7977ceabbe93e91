"""Rate-limited reports of what a master dropped: one line per kind per window, not one per message.

A master on a shared network hears all sorts (workers of another release, a port scanner, a peer
sending garbage as fast as it can): the first of a kind is logged at once with its details, the
rest in one summary line per kind per ``window_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# kind -> (one, many): what a line calls one dropped message of the kind, and several
KINDS: dict[str, tuple[str, str]] = {
    "unreadable": ("unreadable message", "unreadable messages"),
    "oversized": ("oversized message", "oversized messages"),
    "version": ("hello of another version", "hellos of another version"),
    "secret": ("hello without the run's secret", "hellos without the run's secret"),
    "key": ("connection with a key not authorised", "connections with keys not authorised"),
    "stray": ("message from a peer that has not said hello", "messages from peers that have not said hello"),
    "lost": ("message from a worker declared lost", "messages from workers declared lost"),
    "crowd": ("hello while too many peers wait for start()", "hellos while too many peers wait for start()"),
    "refused": ("hello from a peer refused for a while", "hellos from peers refused for a while"),
}


@dataclass
class _Window:
    opened: float
    count: int = 0
    peers: set[str] = field(default_factory=set)
    latest: str = ""


class DropLog:
    """Counts dropped messages by kind; :meth:`flush` (called often) writes the summaries that are due."""

    def __init__(
        self, log: logging.Logger, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log, self._window_s, self._clock = log, window_s, clock
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()  # drop() may come from another thread than flush()
        self._totals: dict[str, int] = {}  # every drop since the start, by kind

    def drop(self, kind: str, peer: str, detail: str) -> None:
        """Note one dropped message of ``kind`` (a key of :data:`KINDS`) from ``peer`` (its address, or
        any name for it); ``detail`` says why."""
        with self._lock:
            self._totals[kind] = self._totals.get(kind, 0) + 1
            window = self._windows.get(kind)
            if window is not None:  # summarised when the window is over
                window.count += 1
                window.peers.add(peer)
                window.latest = detail
                return
            self._windows[kind] = _Window(self._clock())  # the first in a while: said now, in full
        self._log.warning(
            "dropped one %s from %s: %s (more are summarised every %g s)", KINDS[kind][0], peer, detail, self._window_s
        )

    def counts(self) -> dict[str, int]:
        """Every drop so far, by kind."""
        with self._lock:
            return dict(self._totals)

    def flush(self) -> None:
        """Log one summary line per kind whose window is over and saw drops after its first line."""
        now = self._clock()
        due = []
        with self._lock:
            for kind, window in list(self._windows.items()):
                if now - window.opened < self._window_s:
                    continue
                if window.count:
                    due.append((kind, window))
                    self._windows[kind] = _Window(now)  # keep summarising while they keep coming
                else:
                    del self._windows[kind]  # a quiet window: the next one is logged in full again
        for kind, window in due:
            many = KINDS[kind][1 if window.count > 1 else 0]
            peers = f"{len(window.peers)} peer{'' if len(window.peers) == 1 else 's'}"
            latest = f"in the last {self._window_s:g} s; the latest: {window.latest}"
            self._log.warning("dropped %d %s from %s %s", window.count, many, peers, latest)
