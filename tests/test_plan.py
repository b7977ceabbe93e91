"""Plans: participants' spans of kernels, halos and input channels, built from counts."""

from __future__ import annotations

from tinyconv.distributed.shard.plan import Participant, Plan

SEATS = [("master", None), ("worker0", 0), ("worker1", 1)]
LRN5 = [{"op": "relu"}, {"op": "lrn", "size": 5, "alpha": 1e-4, "beta": 0.75, "k": 2.0}]


def test_counts_become_contiguous_spans_in_participant_order():
    plan = Plan.of(SEATS, [3, 0, 4], [])
    assert plan.participants == (
        Participant("master", None, slice(0, 3), slice(0, 3)),
        Participant("worker0", 0, slice(3, 3), slice(3, 3)),
        Participant("worker1", 1, slice(3, 7), slice(3, 7)),
    )
    assert plan.counts == [3, 0, 4] and plan.channel_counts is None
    assert [p.name for p in plan.active] == ["master", "worker1"]  # worker0 has nothing this step
    assert plan.master.name == "master" and [p.name for p in plan.workers] == ["worker1"]


def test_a_tail_with_lrn_widens_each_span_by_its_halo_within_the_layer():
    plan = Plan.of(SEATS, [6, 2, 12], LRN5)  # LRN of size 5: 4 kernels each side, clipped to [0, 20)
    assert [p.halo for p in plan.participants] == [slice(0, 10), slice(2, 12), slice(4, 20)]
    assert [p.own for p in plan.participants] == [(0, 6), (4, 6), (4, 16)]  # offsets into the halo


def test_input_channels_go_with_the_kernels_when_the_layer_is_split_by_them():
    plan = Plan.of(SEATS, [4, 4, 2], [], channel_counts=[3, 2, 1])
    assert [p.channels for p in plan.participants] == [slice(0, 3), slice(3, 5), slice(5, 6)]
    assert plan.channel_counts == [3, 2, 1]


def test_a_master_that_only_coordinates_has_no_seat():
    plan = Plan.of(SEATS[1:], [5, 5], [])
    assert plan.master is None and [p.worker for p in plan.workers] == [0, 1]
