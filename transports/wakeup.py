"""A way to wake an I/O thread that waits on its sockets (``zmq.Poller``, ``select``, ``selectors``): another
thread, which may not touch them, queues what it has and calls :meth:`Wakeup.wake`; the I/O thread waits on
:meth:`Wakeup.fileno` beside its sockets and calls :meth:`Wakeup.drain` when it fired.
"""

from __future__ import annotations

import socket


class Wakeup:
    """A non-blocking socketpair: one end to poll, the other to nudge."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        """The descriptor to wait on for reading (``zmq.POLLIN`` in a ``zmq.Poller``)."""
        return self._r.fileno()

    def wake(self) -> None:
        """Nudge the poller. Safe from any thread; a full buffer already means 'awake'."""
        try:
            self._w.send(b"\0")
        except OSError:  # BlockingIOError when full; closed at shutdown: nothing left to wake
            pass

    def drain(self) -> None:
        """Empty the pair, so the next poll waits again."""
        try:
            while self._r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()
