"""Backends: the Backend interface (``backends/base.py``) and the devices that implement it, found by name.

    from backends import get_backend, available_backends
    be = get_backend("numpy")          # or tinyconv.get_backend

A backend is a class registered under the entry-point group ``tinyconv.backends``, so a separate
package can add one (docs/writing-a-backend.md); :data:`BUILTIN` names the built-in ones for a
source checkout that was never pip-installed (``pyproject.toml`` registers them too).
"""

from __future__ import annotations

import inspect
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from backends.base import Backend

__all__ = ["Backend", "as_backend", "available_backends", "get_backend", "has_devices", "load_backend"]

GROUP = "tinyconv.backends"
BUILTIN = {"numpy": "backends.numpy_backend:NumpyBackend", "opencl": "backends.opencl:OpenCLBackend"}


def registered() -> dict[str, str]:
    """Name -> "module:Class" for every backend that can be asked for."""
    return {**BUILTIN, **{ep.name: ep.value for ep in entry_points(group=GROUP)}}


def load_backend(name: str) -> type[Backend]:
    """The class registered as ``name``; a ValueError listing the choices for an unknown one."""
    table = registered()
    if name not in table:
        raise ValueError(
            f"unknown backend {name!r}; available: {', '.join(sorted(table))}. "
            f"A third-party backend registers under the entry-point group {GROUP!r}."
        )
    module, _, attr = table[name].partition(":")
    return getattr(import_module(module), attr)


def available_backends() -> list[str]:
    """Names of every backend that can be asked for (not all may run on this machine)."""
    return sorted(registered())


def has_devices(backend: str) -> bool:
    """Whether a backend lets one choose its device (its constructor takes ``device``)."""
    return "device" in inspect.signature(load_backend(backend)).parameters


def get_backend(name: str, **options: Any) -> Backend:
    """A new instance of the backend registered as ``name``; options go to its constructor."""
    return load_backend(name)(**options)


def as_backend(backend: str | Backend, **options: Any) -> Backend:
    """``backend`` itself if it is a Backend, else the one registered under that name."""
    return get_backend(backend, **options) if isinstance(backend, str) else backend
