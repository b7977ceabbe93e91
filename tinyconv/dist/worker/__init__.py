"""The worker: serves a master's tasks on one device.

``handler.py`` answers the tasks (one small method per task kind; the split by input
channels in ``channel_handlers.py``, data parallelism and the hybrid in ``replica_handlers.py``, what a
step keeps in ``kept.py``), and ``main.py`` is ``tinyconv worker``, which sets thread
variables before anything imports numpy -- which is why this file imports nothing. The
master starts and stops its workers in ``tinyconv/dist/pool.py``.
"""
