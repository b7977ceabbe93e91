"""The worker: serves a master's tasks on one device (``handler.py``); ``main.py`` is ``tinyconv worker``.

This file imports nothing: ``main.py`` sets thread variables before anything imports numpy.
"""
