"""Where the GEMM's tuned choices are kept between runs: one small JSON file per user (docs/gpus.md).

{"<device> | <driver> | gemm.cl <digest>": {"<call site> M.. N.. K.. KI..": {config..., "ms": ..}}}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import platformdirs  # a dependency of pyopencl

log = logging.getLogger(__name__)

ENV_TUNE_FILE = "TINYCONV_OPENCL_TUNE_FILE"  # where the tuned choices are kept


def default_tune_file() -> Path:
    """$TINYCONV_OPENCL_TUNE_FILE, else tinyconv/opencl-gemm.json in the user cache directory."""
    if os.environ.get(ENV_TUNE_FILE):
        return Path(os.environ[ENV_TUNE_FILE])
    return Path(platformdirs.user_cache_dir("tinyconv", False)) / "opencl-gemm.json"


def source_digest() -> str:
    """A short digest of gemm.cl, the kernels the tuned choices were timed with."""
    return hashlib.sha256((Path(__file__).parent / "gemm.cl").read_bytes()).hexdigest()[:12]


def read(path: Path) -> dict[str, Any]:
    """The whole file, or {} if it is missing, unreadable or not a JSON object."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def load_entry(path: Path, device_key: str, shape_key: str) -> dict[str, Any] | None:
    """The entry kept for one shape on one device, if any."""
    device = read(path).get(device_key)
    entry = device.get(shape_key) if isinstance(device, dict) else None
    return entry if isinstance(entry, dict) else None


def save_entry(path: Path, device_key: str, shape_key: str, entry: dict[str, Any]) -> None:
    """Merge one entry into the file (re-read first: other processes share it)."""
    data = read(path)
    device = data.get(device_key)
    if not isinstance(device, dict):
        device = data[device_key] = {}
    device[shape_key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    except OSError as e:  # a read-only home is no reason to fail a training run
        log.warning("could not save GEMM tuning to %s: %s", path, e)
