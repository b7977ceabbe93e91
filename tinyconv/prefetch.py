"""Prefetching: the next batches are prepared on a background thread while the current step computes.

Gathering the shuffled images, cropping, flipping and normalising (``tinyconv/data.py``) are numpy
copies that release the GIL, so a thread can make batch b+1 while the main thread runs step b.

The numbers are those of the loop without the thread, bit for bit: the thread works through the
batches in order with its *own copy* of the augmentation generator, and each batch carries the
generator's state after it was made, which the trainer adopts only when that batch's step is
committed (so a checkpoint, a rolled-back step or a resume sees the state the plain loop would have).
Leaving the ``with`` block (normally, on an error, on Ctrl-C) stops the thread and joins it.
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


class Prefetcher:
    """Makes ``make_batch(b, rng)`` for every b of ``indices``, in order, on a thread at most ``depth`` ahead
    (memory: depth batches of float32 images); ``depth`` 0 (``--prefetch 0``): no thread, each batch made
    when ``next()`` asks for it, the same batches. They draw from a generator of their own, started at
    ``rng_state``. ``timeout_s``: how long ``next()`` waits for a batch before it raises TimeoutError --
    making one takes milliseconds.
    """

    def __init__(
        self,
        make_batch: MakeBatch,
        indices: Iterable[int],
        rng_state: dict[str, Any],
        depth: int = 2,
        timeout_s: float = 60.0,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be an int >= 0, got {depth!r}")
        self._make, self._indices, self._timeout_s = make_batch, list(indices), timeout_s
        bit_generator = getattr(np.random, rng_state["bit_generator"])()  # of the kind the state names (PCG64)
        bit_generator.state = rng_state
        self._rng = np.random.Generator(bit_generator)
        self._queue: queue.Queue[Batch | BaseException] = queue.Queue(maxsize=depth)  # an exception: making one raised
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinyconv-prefetch", daemon=True) if depth else None
        self._handed = 0
        self.waited_s = 0.0  # how long the last next() waited (without a thread: how long making the batch took)

    def __enter__(self) -> Prefetcher:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _batch(self, b: int) -> Batch:
        x, y = self._make(b, self._rng)
        return Batch(b, x, y, self._rng.bit_generator.state)

    def _run(self) -> None:
        for b in self._indices:
            try:
                item: Batch | BaseException = self._batch(b)
            except BaseException as e:  # handed to the main thread, which raises it where the step is
                item = e
            self._queue.put(item)  # close() sets the stop flag, then empties the queue: this put ends
            if self._stop.is_set() or isinstance(item, BaseException):
                return

    def next(self) -> Batch:
        """The next batch in order; re-raises what making it raised. Sets ``waited_s``."""
        if self._handed >= len(self._indices):
            raise IndexError(f"all {len(self._indices)} batches were already handed out")
        t0 = time.perf_counter()
        if self._thread is None:
            item = self._batch(self._indices[self._handed])
        elif not self._thread.is_alive() and self._queue.empty():  # it raised, and that was re-raised already
            raise RuntimeError("the prefetch thread has stopped: making a batch raised (above); start a new one")
        else:
            try:
                item = self._queue.get(timeout=self._timeout_s)
            except queue.Empty:
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
        """Stop the thread and wait for it (it ends within one batch's making)."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._stop.set()
        while True:  # empty the queue, so a put in progress cannot wait on it
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=self._timeout_s)
