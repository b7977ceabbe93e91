"""The worker: serves a master's tasks on one device.

``handler.py`` answers the tasks through a table of plain handler functions (the split by kernels
there, by input channels in ``channel_handlers.py``, data parallelism and the hybrid in
``replica_handlers.py``, calibration in ``../calibrate.py``), each given the worker's state (``state.py``:
what a step keeps, and which task may follow which); ``main.py`` is ``tinyconv worker``, which sets
thread variables before anything imports numpy -- which is why this file imports nothing. The
master starts and stops its workers in ``tinyconv/distributed/pool.py``.
"""
