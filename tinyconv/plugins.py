"""The registry: backends and transports, found by name.

A backend or a transport is a class registered under an entry-point group,
``tinyconv.backends`` or ``tinyconv.transports``, so a separate package can add one
without touching this repository (docs/writing-a-backend.md). The built-in ones
register the same way (``pyproject.toml``); :data:`BUILTIN` is only the fallback for a
source checkout that was never pip-installed.

Only code that picks a backend or a transport by name needs this, and that code is
tinyconv's: ``backends/`` and ``transports/`` define the interfaces and never import
tinyconv.
"""

from __future__ import annotations

import inspect
from importlib import import_module
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.base import Backend
    from transports.base import Transport

GROUPS = {"backend": "tinyconv.backends", "transport": "tinyconv.transports"}

BUILTIN = {
    "backend": {
        "numpy": "backends.numpy_backend:NumpyBackend",
        "opencl": "backends.opencl:OpenCLBackend",
    },
    "transport": {
        "inproc": "transports.inproc:InprocTransport",
        "zmq": "transports.zmq_master:ZmqTransport",
        "mpi": "transports.mpi_master:MpiTransport",
    },
}


def registered(kind: str) -> dict[str, str]:
    """Name -> "module:Class" for every ``kind`` ("backend" or "transport") that can be asked for."""
    found = dict(BUILTIN[kind])
    for ep in entry_points(group=GROUPS[kind]):
        found[ep.name] = ep.value
    return found


def load(kind: str, name: str) -> type:
    """The class registered as ``name``; a ValueError listing the choices for an unknown one."""
    table = registered(kind)
    if name not in table:
        raise ValueError(
            f"unknown {kind} {name!r}; available: {', '.join(sorted(table))}. "
            f"A third-party {kind} registers under the entry-point group {GROUPS[kind]!r}."
        )
    module, _, attr = table[name].partition(":")
    return getattr(import_module(module), attr)


def has_devices(backend: str) -> bool:
    """Whether a backend lets one choose its device (its constructor takes ``device``)."""
    return "device" in inspect.signature(load("backend", backend)).parameters


def available_backends() -> list[str]:
    """Names of every backend that can be asked for (not all may run on this machine)."""
    return sorted(registered("backend"))


def available_transports() -> list[str]:
    """Names of every transport that can be asked for."""
    return sorted(registered("transport"))


def get_backend(name: str, **options: Any) -> Backend:
    """A new instance of the backend registered as ``name``; options go to its constructor."""
    return load("backend", name)(**options)


def get_transport(name: str, **options: Any) -> Transport:
    """A new instance of the transport registered as ``name``; options go to its constructor.

    Every built-in transport ignores options meant for another one, so a caller can
    pass one set (``handler_factory=...``, ``bind=...``, ``protocol=...``).
    """
    return load("transport", name)(**options)


def as_backend(backend: str | Backend, **options: Any) -> Backend:
    """``backend`` itself if it is a Backend, else the one registered under that name."""
    return get_backend(backend, **options) if isinstance(backend, str) else backend
