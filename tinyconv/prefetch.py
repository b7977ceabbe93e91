"""Prefetching: the next batches are prepared on a background thread while the current step computes.

Gathering the shuffled images, cropping, flipping and normalising (``tinyconv/data.py``) are numpy
copies that release the GIL, so a thread can make batch b+1 while the main thread runs step b.

The numbers are those of the loop without the thread, bit for bit: the thread works through the
batches in order with its *own copy* of the augmentation generator, and each batch carries the
generator's state after it was made, which the trainer adopts only when that batch's step is
committed (so a checkpoint, a rolled-back step or a resume sees the state the plain loop would have):

    with Prefetcher(make_batch, range(b0, b1), rng_state, depth=2) as batches:
        for b in range(b0, b1):
            batch = batches.next()           # waits only if it is not ready; ``batches.waited_s``: how long
            ... step on batch.x, batch.y ...
            rng.bit_generator.state = batch.rng_state    # on commit

Leaving the ``with`` block (normally, on an error, on Ctrl-C) stops the thread and joins it; its
``put`` gives up every ``poll_s`` to look at the stop flag, so it ends within one poll and one batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Batch:
    """One prepared batch: its index in the epoch, x float32 (B, C, H, W), y int64 (B,), and the
    augmentation generator's state after it was drawn (to adopt when its step is committed)."""

    index: int
    x: np.ndarray
    y: np.ndarray
    rng_state: dict[str, Any]


# make_batch(b, rng) -> (x float32 (B, C, H, W), y (B,)): batch b of the epoch, drawing from rng
MakeBatch = Callable[[int, np.random.Generator], tuple[np.ndarray, np.ndarray]]


def generator_at(state: dict[str, Any]) -> np.random.Generator:
    """A fresh Generator whose bit generator (of the kind ``state`` names, e.g. PCG64) is at ``state``."""
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)


class InOrder:
    """The simple version, no thread: ``next()`` makes each batch when it is asked for (``--prefetch 0``).

    Same interface and the same batches as :class:`Prefetcher`; ``waited_s`` is then the time making
    the batch took, all of it in the step."""

    def __init__(self, make_batch: MakeBatch, indices: Iterable[int], rng_state: dict[str, Any]) -> None:
        self._make, self._indices, self._rng = make_batch, iter(indices), generator_at(rng_state)
        self.waited_s = 0.0

    def __enter__(self) -> InOrder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def next(self) -> Batch:
        t0 = time.perf_counter()
        b = next(self._indices)
        x, y = self._make(b, self._rng)
        self.waited_s = time.perf_counter() - t0
        return Batch(b, x, y, self._rng.bit_generator.state)


class Prefetcher:
    """Makes ``make_batch(b, rng)`` for every b of ``indices`` on a thread, at most ``depth`` ahead.

    ``rng_state``: the augmentation generator's ``bit_generator.state`` before the first batch;
    the thread draws from its own generator started there (a PCG64 like the trainer's).
    ``depth`` >= 1: how many batches may wait ready (memory: depth batches of float32 images).
    ``timeout_s``: how long ``next()`` waits for a batch before it raises TimeoutError -- only if
    the thread made no progress at all in that time, since making one batch takes milliseconds.
    """

    def __init__(
        self,
        make_batch: MakeBatch,
        indices: Iterable[int],
        rng_state: dict[str, Any],
        depth: int = 2,
        timeout_s: float = 60.0,
        poll_s: float = 0.05,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch depth must be an int >= 1, got {depth!r}")
        self._make, self._indices = make_batch, list(indices)
        self._rng = generator_at(rng_state)
        self._queue: queue.Queue[Batch | BaseException] = queue.Queue(maxsize=depth)  # an exception: making one raised
        self._stop = threading.Event()
        self._timeout_s, self._poll_s = timeout_s, poll_s
        self._thread = threading.Thread(target=self._run, name="tinyconv-prefetch", daemon=True)
        self._handed = 0
        self.waited_s = 0.0  # how long the last next() waited

    def __enter__(self) -> Prefetcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        for b in self._indices:
            try:
                x, y = self._make(b, self._rng)
                item: Batch | BaseException = Batch(b, x, y, self._rng.bit_generator.state)
            except BaseException as e:  # handed to the main thread, which raises it where the step is
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=self._poll_s)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def next(self) -> Batch:
        """The next batch in order; re-raises what making it raised. Sets ``waited_s``."""
        if self._handed >= len(self._indices):
            raise IndexError(f"all {len(self._indices)} batches were already handed out")
        t0 = time.perf_counter()
        deadline = t0 + self._timeout_s
        while True:
            try:
                item = self._queue.get(timeout=self._poll_s)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch thread ended without making the next batch") from None
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"no batch from the prefetch thread in {self._timeout_s:g} s: making one batch "
                        f"should take milliseconds; is the machine swapping?"
                    ) from None
        self.waited_s = time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        self._handed += 1
        return item

    def close(self) -> None:
        """Stop the thread and wait for it (it ends within a poll and one batch's making)."""
        self._stop.set()
        while True:  # empty the queue, so a put in progress cannot wait on it
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout_s)
