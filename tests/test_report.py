"""The end-of-run summary: who sat a layer out and why, shares by participant, a time per epoch
even for a run shorter than one."""

from __future__ import annotations

import tracemalloc

from tinyconv.report import Tally, summarize, summary_table

NAMES = ["master", "worker0", "worker1"]


def _split(conv1: list[int], conv2: list[int], channels: list[int] | None = None) -> dict:
    return {
        "comm_s": 0.1, "conv_s": 0.5, "comp_s": 0.1, "bytes_sent": 10, "bytes_recv": 5, "participants": NAMES,
        "participant_bytes_sent": [0, 5, 5], "participant_bytes_recv": [0, 3, 2],
        "shares": {"conv1": conv1, "conv2": conv2}, "channel_shares": {"conv2": channels} if channels else {},
    }  # fmt: skip


def _tally(times: list[float], splits: list[dict]) -> Tally:
    """The steps as the trainer adds them: a distributed step's record holds its split."""
    tally = Tally()
    for i, t in enumerate(times):
        tally.add({"time_s": t, **(splits[i] if i < len(splits) else {})})
    return tally


def sat_out(splits: list[dict]) -> list[dict]:
    return _tally([0.7] * len(splits), splits).sat_out()


def _history(complete: bool, time_s: float = 3.0) -> list[dict]:
    return [{"complete": complete, "time_s": time_s, "train_loss": 2.0, "test_loss": 2.1, "test_acc": 0.2}]


def test_a_participant_the_rebalancer_sits_out_is_named_with_its_reason():
    # worker1 held a kernel of conv2 for 2 steps, then none (too slow); conv1 has kernels enough for all
    splits = [_split([2, 1, 1], [5, 2, 1])] * 2 + [_split([2, 1, 1], [6, 2, 0])] * 3
    summary = summarize(_history(False), _tally([0.7] * 5, splits), epoch=0, step=5)
    assert summary["sat_out"] == [
        {"participant": "worker1", "layer": "conv2", "steps": 3, "of": 5, "reason": "too slow", "kernels": 8,
         "participants": 3},
    ]  # fmt: skip
    table = summary_table(summary, steps_per_epoch=100)
    assert "worker1 sat out conv2 in 3 of 5 steps: too slow for one kernel's worth" in table
    assert "conv1: master 2, worker0 1, worker1 1; conv2: master 6, worker0 2, worker1 0" in table


def test_fewer_kernels_than_participants_is_said_so():
    splits = [_split([1, 1, 0], [4, 3, 1])] * 4
    (sat,) = sat_out(splits)
    assert (sat["participant"], sat["reason"]) == ("worker1", "too few kernels")
    summary = summarize(_history(False), _tally([0.7] * 4, splits), epoch=0, step=4)
    assert "worker1 sat out conv1 in every step: conv1 has 2 kernels for 3 participants" in summary_table(summary)


def test_input_channels_count_as_work():
    # no kernels of conv2 but two of its input channels: it computes partial sums, it did not sit out
    assert sat_out([_split([2, 1, 1], [6, 2, 0], channels=[1, 1, 2])]) == []


def test_time_per_epoch_is_projected_for_a_run_shorter_than_one():
    summary = summarize(_history(False), _tally([0.5, 0.7, 0.6], []), epoch=0, step=3)
    assert summary["time_per_epoch_s"] is None  # the file keeps what was measured
    table = summary_table(summary, steps_per_epoch=781)
    assert "| time per epoch (projected from 3 steps) | 7 min 49 s" in table  # 0.6 s x 781
    assert "time per epoch" not in summary_table(summary)  # nothing to project from
    whole = summarize(_history(True, 400.0), _tally([0.5] * 781, []), epoch=1, step=781)
    table = summary_table(whole, steps_per_epoch=781)
    assert "| time per epoch " in table and "6 min 40 s" in table and "projected" not in table


def test_a_summary_without_names_keeps_its_lists():
    table = summary_table({"final_shares": {"conv1": [1, 2]}})  # an older summary: no participants
    assert "conv1: [1, 2]" in table


def test_data_parallel_image_shares_are_said_in_images():
    slow = {**_split([0], [0]), "shares": {"batch": [40, 24, 0]}, "channel_shares": {}}
    few = {**_split([0], [0]), "shares": {"batch": [1, 1, 0]}, "channel_shares": {}}
    busy = {**_split([0], [0]), "shares": {"batch": [40, 20, 4]}, "channel_shares": {}}
    summary = summarize(_history(False), _tally([0.7] * 4, [slow] * 3 + [busy]), epoch=0, step=4)
    table = summary_table(summary)
    assert "worker1 sat out the batch in 3 of 4 steps: too slow for one image's worth" in table
    assert "whole slice" in table and "kernel" not in table.split("sat out")[1]
    (sat,) = sat_out([few])
    assert sat["reason"] == "too few kernels"  # the record's reason names the case; the sentence, the unit
    assert "the batch has 2 images for 3 participants" in summary_table(
        summarize(_history(False), _tally([0.7], [few]), epoch=0, step=1)
    )


def test_the_tally_holds_the_same_memory_however_long_the_run():
    # the medians come from the last `window` steps; the bytes and who sat out count every step
    tally = Tally(window=4)
    for t in range(1, 11):
        tally.add({**_split([2, 1, 1], [6, 2, 0]), "time_s": float(t)})
    summary = summarize(_history(False), tally, epoch=0, step=10)
    assert summary["median_step_s"] == 8.5  # steps 7..10
    assert summary["bytes_sent"] == 100 and summary["participant_bytes_recv"] == {"master": 0, "worker0": 30,
                                                                                 "worker1": 20}  # fmt: skip
    assert summary["sat_out"][0]["steps"] == 10
    tracemalloc.start()
    try:
        tally = Tally()
        for _ in range(1000):
            tally.add(_split([2, 1, 1], [5, 2, 1]))
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            tally.add(_split([2, 1, 1], [5, 2, 1]))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 4096, f"the tally grew {grown} bytes over 20,000 steps"
