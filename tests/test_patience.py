"""A peer's patience (transports/session/patience.py), with explicit times: no clock, no sleep."""

from __future__ import annotations

import pytest

from transports.session.patience import Patience


def test_a_peer_that_keeps_its_pace_may_be_silent_for_four_heartbeats():
    p = Patience(pace_s=0.4, ceiling_s=30.0, now=100.0)
    assert p.limit() == pytest.approx(1.6)
    p.arrived(101.0)  # a heartbeat measures nothing
    assert p.limit() == pytest.approx(1.6) and p.lost(102.6) == ""
    assert p.lost(102.7) == "silent for 1.7 s (patience 1.6 s: 4 heartbeats; at most 30 s)"


def test_pieces_further_apart_than_four_heartbeats_are_waited_for_while_they_flow():
    p = Patience(pace_s=0.4, ceiling_s=30.0, now=0.0)
    p.arrived(1.0, piece=True)  # a slow link: the first piece a second after the last heartbeat
    assert p.limit() == pytest.approx(3.0)
    for t in (3.5, 6.0, 8.5):  # each 2.5 s after the last, longer than 4 heartbeats, within the patience
        assert p.lost(t - 0.01) == ""
        p.arrived(t, piece=True)
    assert p.limit() == pytest.approx(7.5)
    p.arrived(8.6, piece=True)  # a shorter gap does not shorten the patience
    assert p.limit() == pytest.approx(7.5) and p.lost(16.0) == ""
    assert p.lost(16.2) == "silent for 7.6 s (patience 7.5 s: 3 x the longest gap before a piece, 2.5 s; at most 30 s)"


def test_the_patience_is_at_most_its_ceiling():
    p = Patience(pace_s=0.4, ceiling_s=5.0, now=0.0)
    p.arrived(4.0, piece=True)  # 3 x 4 s would be 12 s
    assert p.limit() == 5.0 and p.lost(9.0) == ""
    assert p.lost(9.1) == "silent for 5.1 s (patience 5.0 s: the ceiling, peer_timeout_s)"
