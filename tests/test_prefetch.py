"""The prefetch thread (tinyconv/prefetch.py): the same batches as making them in order, errors
handed to the caller, and no thread left running however the loop ends."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tinyconv.prefetch import Prefetcher


def _make(b: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A batch that depends on its index and on what it draws, as augmentation does."""
    x = rng.standard_normal((2, 3)).astype(np.float32) + b
    return x, np.full(2, b)


def _state() -> dict:
    return np.random.default_rng([7, 2]).bit_generator.state


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tinyconv-prefetch"]


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_batches_and_generator_states_equal_the_ones_made_in_order(depth):
    with Prefetcher(_make, range(2, 9), _state(), depth=0) as plain:
        expected = [plain.next() for _ in range(7)]
    with Prefetcher(_make, range(2, 9), _state(), depth=depth) as ahead:
        got = [ahead.next() for _ in range(7)]
        assert ahead.waited_s >= 0.0
    assert [b.index for b in got] == list(range(2, 9))
    for e, g in zip(expected, got, strict=True):
        assert np.array_equal(e.x, g.x) and np.array_equal(e.y, g.y)
        assert e.rng_state == g.rng_state  # what the trainer adopts when the step is committed
    assert not _threads()


def test_an_error_making_a_batch_is_raised_by_next_and_ends_the_thread():
    def make(b, rng):
        if b == 2:
            raise OSError("disk gone")
        return _make(b, rng)

    with Prefetcher(make, range(5), _state()) as ahead:
        ahead.next(), ahead.next()
        with pytest.raises(OSError, match="disk gone"):
            ahead.next()
    assert not _threads()


def test_leaving_early_stops_a_thread_blocked_on_a_full_queue():
    with pytest.raises(KeyboardInterrupt):
        with Prefetcher(_make, range(100), _state(), depth=1) as ahead:
            ahead.next()
            raise KeyboardInterrupt  # as Ctrl-C in the middle of an epoch
    assert not _threads()


def test_next_past_the_end_and_a_bad_depth_are_refused():
    with Prefetcher(_make, range(1), _state()) as ahead:
        ahead.next()
        with pytest.raises(IndexError, match="already handed out"):
            ahead.next()
    with pytest.raises(ValueError, match="depth must be an int >= 0"):
        Prefetcher(_make, range(1), _state(), depth=-1)


def test_asking_again_after_the_thread_raised_says_so_at_once():
    """After a batch's making raised (and next() re-raised it), the next call says the thread has stopped."""

    def make(b, rng):
        raise ValueError("a corrupt image")

    state = np.random.default_rng(0).bit_generator.state
    with Prefetcher(make, range(3), state, depth=2, timeout_s=30.0) as p:
        with pytest.raises(ValueError, match="a corrupt image"):
            p.next()
        p._thread.join(timeout=30.0)
        with pytest.raises(RuntimeError, match="has stopped"):
            p.next()
