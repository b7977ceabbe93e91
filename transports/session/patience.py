"""How long a peer may be silent before it is lost: :class:`Patience`, which follows the peer's pace.

A fixed timeout is wrong both ways: long enough for a slow link, it is slow to see a stopped peer on a quick one.
So the patience is a few of the heartbeats the peer keeps, or, once a large message comes in pieces
(``transports/pieces.py``), a few of the longest gaps its link has shown between them; the user's
``peer_timeout_s`` is only a ceiling. The master keeps one per worker, a worker one for its master.
"""

from __future__ import annotations

HEARTBEATS = 4  # a peer is silent for this many of its heartbeats: one late heartbeat is not a loss
GAPS = 3  # ... or for this many of the longest gap its link has shown before a piece


class Patience:
    """One peer's silence, measured against ``pace_s`` (the heartbeat pace it keeps) and the gaps before its
    pieces, at most ``ceiling_s``. Times are ``time.monotonic()`` readings, passed in by the caller."""

    def __init__(self, pace_s: float, ceiling_s: float, now: float) -> None:
        self.pace_s, self.ceiling_s = pace_s, ceiling_s
        self.heard = now  # when anything last came from the peer
        self.said = now  # when anything was last sent to it: a heartbeat is due after a heartbeat's quiet
        self.gap = 0.0  # the longest gap seen between an arrival and the piece that followed it

    def arrived(self, now: float, piece: bool = False) -> None:
        """Something came from the peer at ``now``; a ``piece`` of a large message also measures its link."""
        if piece:
            self.gap = max(self.gap, now - self.heard)
        self.heard = now

    def limit(self) -> float:
        """How long the peer may be silent now."""
        return min(self.ceiling_s, max(HEARTBEATS * self.pace_s, GAPS * self.gap))

    def lost(self, now: float) -> str:
        """ "" while the peer is within its patience at ``now``; else why it is lost, and which rule set the limit."""
        silent, limit = now - self.heard, self.limit()
        if silent <= limit:
            return ""
        if limit == self.ceiling_s:
            rule = "the ceiling, peer_timeout_s"
        elif GAPS * self.gap > HEARTBEATS * self.pace_s:
            rule = f"{GAPS} x the longest gap before a piece, {self.gap:.1f} s; at most {self.ceiling_s:g} s"
        else:
            rule = f"{HEARTBEATS} heartbeats; at most {self.ceiling_s:g} s"
        return f"silent for {silent:.1f} s (patience {limit:.1f} s: {rule})"
