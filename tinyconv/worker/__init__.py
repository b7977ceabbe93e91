"""The worker: serves a master's tasks on one device.

``handler.py`` answers the tasks (one small method per task kind), ``main.py`` is
``tinyconv worker`` (it sets thread variables before anything imports numpy, which is why
this file imports nothing), and ``pool.py`` starts and stops a master's local workers.
"""
