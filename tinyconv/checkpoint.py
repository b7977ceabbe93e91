"""Checkpoints: parameters, optimizer state, progress and RNG state in one .npz file.

Nothing is pickled (arrays as arrays, the rest as one JSON string), so a checkpoint from anywhere is safe
to load. A write goes to a temporary file, fsynced, renamed over the old checkpoint, and the folder
fsynced: a crash at any moment leaves the old checkpoint or the new one, never half of one.
Reading checks everything a run relies on: a damaged file or one of another run (network, batch size,
epoch length, warm-up) is one ValueError that says what is wrong. A distributed run's checkpoint keeps
its split (:func:`plan_of`), which a run of the same participants takes up again (:func:`restore_plan`).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tinyconv.parallel import Parallel

FORMAT = "tinyconv-checkpoint-2"  # parameters keyed by layer name ("conv1.w")
TMP_SUFFIX = ".tmp"
ZIP_MAGIC = b"PK\x03\x04"  # how an .npz (a zip archive) starts

# meta fields a checkpoint must have, and their JSON types
META_FIELDS: dict[str, type] = {
    "step": int,
    "epoch": int,
    "batch_in_epoch": int,
    "epoch_shuffle_state": dict,
    "augment_state": dict,
    "model_config": dict,
    "train_config": dict,
}
MODEL_FIELDS: dict[str, type] = {"arch": str, "norm": str, "pool_kernel": int}
# what a run must share with the checkpoint it resumes: (where, field, option)
SAME = (("model_config", "arch", "--arch"), ("model_config", "norm", "--norm"),
        ("model_config", "pool_kernel", "--pool"), ("train_config", "batch_size", "--batch-size"))  # fmt: skip


@dataclass
class Checkpoint:
    """A checkpoint as read: model and optimizer arrays by key, and the meta fields."""

    path: Path
    model: dict[str, np.ndarray]
    optim: dict[str, np.ndarray]
    meta: dict[str, Any]


def save_checkpoint(
    path: str | Path, model: dict[str, np.ndarray], optimizer: dict[str, np.ndarray], meta: dict[str, Any]
) -> int:
    """Write model and optimizer arrays plus JSON-able ``meta`` atomically -> the file's size in bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*{TMP_SUFFIX}"):  # what an interrupted save left
        stale.unlink(missing_ok=True)
    arrays = {f"model/{k}": v for k, v in model.items()}
    arrays.update({f"optim/{k}": v for k, v in optimizer.items()})
    arrays["meta"] = np.array(json.dumps({"format": FORMAT, **meta}))
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)  # the umask's mode
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if os.name == "posix":  # the rename made durable (elsewhere a folder cannot be opened, nor needs it)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path.stat().st_size


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a checkpoint: FileNotFoundError if there is none at ``path``, else a one-line ValueError
    for anything wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; check --resume, or train without it first")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty, not a checkpoint: its save never finished; resume from another one")
    with open(path, "rb") as f:
        head = f.read(len(ZIP_MAGIC))
    if head != ZIP_MAGIC:  # else numpy would try it as a pickle, and suggest loading it unsafely
        raise ValueError(
            f"{path} is not a readable tinyconv checkpoint: not an .npz archive (it starts with {head!r}); "
            "was it written by tinyconv?"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            model = {k[6:]: z[k] for k in z.files if k.startswith("model/")}
            optim = {k[6:]: z[k] for k in z.files if k.startswith("optim/")}
    except Exception as e:  # BadZipFile, EOFError, KeyError, ValueError, zlib errors...: any is a bad file
        raise ValueError(
            f"{path} is not a readable tinyconv checkpoint ({type(e).__name__}: {e}); "
            "it may be truncated or corrupted -- was it written by tinyconv?"
        ) from e
    check_meta(meta, path)
    return Checkpoint(path, model, optim, meta)


def check_meta(meta: Any, path: str | Path) -> None:
    """Raise ValueError unless ``meta`` has every field resuming needs, each of its type."""
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a tinyconv checkpoint: its meta is a {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} has format {meta.get('format')!r}, this tinyconv reads {FORMAT!r}")
    _check_fields(meta, META_FIELDS, path, "")
    _check_fields(meta["model_config"], MODEL_FIELDS, path, "model_config.")
    _check_fields(meta["train_config"], {"batch_size": int}, path, "train_config.")
    for key in ("step", "epoch", "batch_in_epoch"):
        if meta[key] < 0:
            raise ValueError(f"{path} is damaged: its meta field {key!r} is {meta[key]}, below 0")
    for key in ("epoch_shuffle_state", "augment_state"):
        try:
            np.random.PCG64().state = meta[key]
        except Exception as e:
            raise ValueError(f"{path} is damaged: its meta field {key!r} is not a generator state ({e})") from e
    if not isinstance(meta.get("history", []), list):
        raise ValueError(f"{path} is damaged: its meta field 'history' is not a list")
    _check_plan(meta.get("plan"), path)


def _check_fields(table: dict[str, Any], fields: dict[str, type], path: str | Path, prefix: str) -> None:
    for key, kind in fields.items():
        if key not in table:
            raise ValueError(f"{path} is damaged or too old: its meta has no field '{prefix}{key}'")
        value = table[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(
                f"{path} is damaged: its meta field '{prefix}{key}' is {value!r} ({type(value).__name__}), "
                f"not a{'n' if kind is int else ''} {kind.__name__}"
            )


def _check_plan(plan: Any, path: str | Path) -> None:
    """The split a distributed run saved (None when nothing was distributed)."""
    if plan is None:
        return
    ok = isinstance(plan, dict) and isinstance(plan.get("participants"), list)
    ok = ok and all(isinstance(p, str) for p in plan["participants"])
    for key in ("counts", "channel_counts"):
        table = plan.get(key) if ok else None
        ok = ok and isinstance(table, dict) and all(_counts(v) for v in table.values())
    if not ok:
        raise ValueError(f"{path} is damaged: its meta field 'plan' is not a split ({plan!r:.200})")


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)


def check_compatible(meta: dict[str, Any], model_config: dict[str, Any], batch_size: int, path: str | Path) -> None:
    """Raise ValueError, naming each option that differs, unless a run of ``model_config`` at ``batch_size``
    can resume from a checkpoint with ``meta``."""
    here = {"model_config": model_config, "train_config": {"batch_size": batch_size}}
    differ = [
        f"{option} {meta[where][key]} there, {here[where][key]} here"
        for where, key, option in SAME
        if meta[where][key] != here[where][key]
    ]
    if differ:
        raise ValueError(
            f"checkpoint {path} is from another run: {'; '.join(differ)}; resume with the options it was written "
            "with (the same --arch, --norm, --pool and --batch-size)"
        )


def check_resumable(
    ck: Checkpoint, model_config: dict[str, Any], batch_size: int, steps_per_epoch: int, warmup_steps: int
) -> None:
    """Raise ValueError unless a run of ``model_config`` at ``batch_size``, with epochs of
    ``steps_per_epoch`` and ``warmup_steps`` of warm-up, can take up ``ck`` where it stopped."""
    meta = ck.meta
    check_compatible(meta, model_config, batch_size, ck.path)
    if meta["batch_in_epoch"] > steps_per_epoch:
        raise ValueError(
            f"checkpoint {ck.path} stopped after batch {meta['batch_in_epoch']} of an epoch, but this "
            f"run's epochs have {steps_per_epoch}: was it trained on another dataset?"
        )
    config = meta["train_config"]
    if "warmup" in config:  # written since: the run's own options decide, as for the lr or the epochs
        return
    # from before ``warmup`` (a fraction) it warmed up for ``warmup_epochs`` epochs, 1 by default: resumed
    # with another warm-up, its schedule would jump, so it is refused unless the same
    epochs = config.get("warmup_epochs", 1.0)
    theirs = int(epochs * steps_per_epoch)
    if theirs != warmup_steps:
        raise ValueError(
            f"checkpoint {ck.path} was trained with a {epochs:g}-epoch warm-up ({theirs} steps), from before "
            f"--warmup; this run's is {warmup_steps} steps: resume it with --warmup-epochs {epochs:g}"
        )


def plan_of(runtime: Parallel | None) -> dict[str, Any] | None:
    """The runtime's split, to save (its participants, their counts and input channels per unit), or None."""
    if runtime is None:
        return None
    counts = {k: [int(n) for n in v] for k, v in runtime.counts.items()}
    channels = {k: [int(n) for n in v] for k, v in runtime.channel_counts.items()}
    return {"participants": list(runtime.participants), "counts": counts, "channel_counts": channels}


def restore_plan(runtime: Parallel | None, plan: dict[str, Any] | None) -> tuple[str | None, bool]:
    """Give ``runtime`` the split ``plan`` saved, if it is of the same units and participants ->
    (a line saying what happened, None if nothing is distributed or saved; whether it was restored)."""
    if runtime is None or plan is None:
        return None, False
    theirs = "images" if "batch" in plan["counts"] else "kernels"  # a split of the batch counts its "batch"
    if theirs != runtime.splits:  # a model-parallel checkpoint resumed data-parallel, or the other way
        return f"the checkpoint's split is not of {runtime.splits}: keeping this run's split", False
    if plan["participants"] != runtime.participants:
        return (
            f"the checkpoint's split is for {', '.join(plan['participants'])}, this run has "
            f"{', '.join(runtime.participants)}: keeping this run's split"
        ), False
    for layer, counts in plan["counts"].items():
        runtime.set_plan(layer, counts, plan["channel_counts"].get(layer))
    shares = "; ".join(f"{layer}: {counts}" for layer, counts in plan["counts"].items())
    return f"the checkpoint's split restored ({', '.join(runtime.participants)}): {shares or 'equal'}", True
