"""Stopping training cleanly: Ctrl-C and SIGTERM become :class:`Stopped`, so the trainer can checkpoint
on the way out, and wait while an update runs, so a checkpoint never holds half of one."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Stopped(KeyboardInterrupt):
    """Training was stopped by a signal: ``signum`` is SIGINT (Ctrl-C) or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """Ctrl-C and SIGTERM as :class:`Stopped`, except inside :meth:`held`, where they wait."""

    def __init__(self) -> None:
        self.holding = False  # inside held(): a signal waits for its end
        self.pending: int | None = None  # a signal that came meanwhile

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM raise :class:`Stopped` inside the block, in the main thread, where nobody else
        handles them: the defaults are in place, or another guard's (a command's start-up), stood in for."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        previous = {s: signal.getsignal(s) for s in defaults}
        mine = [
            s
            for s in defaults
            if previous[s] is defaults[s] or isinstance(getattr(previous[s], "__self__", None), SignalGuard)
        ]
        for s in mine:
            signal.signal(s, self._on_signal)
        try:
            yield
        finally:
            for s in mine:
                signal.signal(s, previous[s])

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending = self.pending or signum
            return
        raise Stopped(signum)

    @contextmanager
    def held(self, raise_pending: bool = True) -> Iterator[None]:
        """Run the block whole: a signal that comes meanwhile is raised at its end (if ``raise_pending``)."""
        outer, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = outer
        if not outer and self.pending is not None:
            signum, self.pending = self.pending, None
            if raise_pending:
                raise Stopped(signum)
