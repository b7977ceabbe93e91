"""Backends: the Backend interface (``backends/base.py``) and the devices that implement it.

Find one by name with ``backends.registry.get_backend("numpy")`` (or ``tinyconv.get_backend``); a separate package
registers its own under the entry-point group ``tinyconv.backends``.
"""

from backends.base import Backend

__all__ = ["Backend"]
