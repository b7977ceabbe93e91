"""Checkpoints: parameters, optimizer state, progress and RNG state in one .npz file.

Nothing is pickled: arrays are stored as arrays and the rest as one JSON string,
so a checkpoint from anywhere is safe to load (``allow_pickle=False``).
Writes are atomic (temporary file, then rename): a crash never leaves half a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "tinyconv-checkpoint-2"  # parameters keyed by layer name ("conv1.w")


def save_checkpoint(
    path: str | Path, model: dict[str, np.ndarray], optimizer: dict[str, np.ndarray], meta: dict[str, Any]
) -> None:
    """Write model and optimizer arrays plus JSON-able ``meta`` (epoch, step, rng states...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"model/{k}": v for k, v in model.items()}
    arrays.update({f"optim/{k}": v for k, v in optimizer.items()})
    arrays["meta"] = np.array(json.dumps({"format": FORMAT, **meta}))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """-> (model arrays, optimizer arrays, meta). Clear ValueError if it isn't one of ours."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; check --resume, or train without it first")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            model = {k[6:]: z[k] for k in z.files if k.startswith("model/")}
            optim = {k[6:]: z[k] for k in z.files if k.startswith("optim/")}
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path} is not a readable tinyconv checkpoint ({e}); was it written by tinyconv?"
        ) from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} has format {meta.get('format')!r}, this tinyconv reads {FORMAT!r}")
    return model, optim, meta
