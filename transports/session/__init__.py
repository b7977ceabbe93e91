"""The session: what every transport that crosses a process boundary does the same way, written once.

A *session* is the life of one worker as a master sees it, and of one master as a worker
sees it: hello (the worker's backend, device and task-protocol version) and welcome (its
index, the heartbeat pace); admission, and its caps (a version that differs is refused and
told why; at most ``MAX_PENDING`` hellos wait for ``start``; a message over
``max_message_bytes`` is refused); heartbeats; loss; joins (an open group admits workers
after ``start``, each under a new index); goodbye (``shutdown``, the paper's "train over").

Below the session, a *link* moves frames and nothing else (:mod:`transports.session.link`):
ZeroMQ's ROUTER and DEALER sockets (:mod:`transports.zmq_master`, :mod:`transports.zmq_worker`),
MPI's point-to-point buffers (:mod:`transports.mpi_master`, :mod:`transports.mpi_worker`), or
any medium a new transport brings (docs/writing-a-transport.md). Above it, the application
sees :class:`~transports.base.Transport` on the master and a
:class:`~transports.base.Handler` on each worker.

* Master side: :class:`~transports.session.master.MasterSession` runs the one I/O thread
  that calls the link, and :class:`~transports.session.admission.Admission` decides, in that
  thread, who becomes a worker; :class:`~transports.session.master.SessionTransport` is the
  Transport API the caller's threads use, talking to that thread through queues.
* Worker side: :class:`~transports.session.worker.Compute` runs the handler in a thread of
  its own, so the link keeps being read and heartbeats keep flowing while a task computes;
  :func:`~transports.session.welcome.greet` says hello until a master welcomes the worker;
  :class:`~transports.session.worker.Serving` serves one master over a worker's link until
  its shutdown or its silence (:mod:`transports.session.settings`: its settings and exit codes).

**Liveness apart from bulk data.** A peer is alive while *anything* comes from it: every
:class:`~transports.session.link.Arrival` counts, a whole message of any kind or only a
sign of life (a link that sees the first bytes of a large message arrive reports them, as
MPI's does when a message's prefix arrives), not just heartbeats. So a worker sending a
large result is not lost because its heartbeat waits behind that result on one stream.
Heartbeats go out only after ``heartbeat_s`` of quiet, and the session marks them
``control=True`` when it hands them to :meth:`~transports.session.link.Link.send`: the one
place where a link with a second lane (another socket, another MPI tag) may send them ahead
of, or beside, the bulk frames queued before them. The built-in links have one lane each and
send everything in order; splitting large messages into chunks, so that control frames can
be interleaved on one lane, would go in the same place.
"""
