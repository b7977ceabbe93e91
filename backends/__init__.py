"""Backend registry: backends are found by name through the ``tinyconv.backends``
entry-point group, so a separate package can add one without touching this repo.

The built-in backends register the same way (see ``pyproject.toml``); the table
below is only the fallback for a source checkout that was never pip-installed.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from backends.base import Backend

ENTRY_POINT_GROUP = "tinyconv.backends"

_BUILTIN = {
    "numpy": "backends.numpy_backend:NumpyBackend",
    "opencl": "backends.opencl:OpenCLBackend",
}


def _load(target: str) -> type[Backend]:
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def _discovered() -> dict[str, str]:
    found = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep.value
    return found


def available_backends() -> list[str]:
    """Names of every backend that can be asked for (not all may run on this machine)."""
    return sorted(_discovered())


def get_backend(name: str, **options: Any) -> Backend:
    """Instantiate the backend registered as ``name``; options go to its constructor."""
    table = _discovered()
    if name not in table:
        raise ValueError(
            f"unknown backend {name!r}; available: {', '.join(sorted(table))}. "
            f"A third-party backend registers under the entry-point group {ENTRY_POINT_GROUP!r}."
        )
    cls = _load(table[name])
    return cls(**options)


__all__ = ["Backend", "available_backends", "get_backend", "ENTRY_POINT_GROUP"]
