"""The session: what every transport that crosses a process boundary does the same way, written once.

A *session* is the life of one worker as a master sees it, and of one master as a worker sees it:
hello and welcome, admission and its caps, heartbeats, loss, joins (an open group admits workers
after ``start``, each under a new index) and goodbye (``shutdown``, the paper's "train over").
Below it a *link* moves frames and nothing else (:mod:`transports.session.link`); above it the
application sees a :class:`~transports.base.Transport` on the master (:mod:`.master`, with
:mod:`.admission`) and its :class:`~transports.base.Handler` on each worker (:mod:`.worker`, with
:mod:`.welcome`). Liveness and heartbeats: docs/writing-a-transport.md.
"""
