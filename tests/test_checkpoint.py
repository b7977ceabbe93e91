"""Checkpoint files: atomic writes, and a clear ValueError for every file that cannot be resumed from."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tinyconv import checkpoint as ck
from tinyconv.checkpoint import check_compatible, read_checkpoint, save_checkpoint


def sound_meta(**changes) -> dict:
    """The meta fields of a checkpoint as the Trainer writes them."""
    state = np.random.default_rng(0).bit_generator.state
    meta = {
        "step": 5,
        "epoch": 0,
        "batch_in_epoch": 5,
        "epoch_shuffle_state": state,
        "augment_state": state,
        "model_config": {"arch": "4:8", "norm": "lrn", "pool_kernel": 3, "conv1": 4, "conv2": 8, "seed": 0},
        "train_config": {"batch_size": 32, "lr": 0.01},
        "history": [],
        "plan": {"participants": ["master", "worker0"], "counts": {"conv1": [2, 2]}, "channel_counts": {}},
    }
    meta.update(changes)
    return meta


def write(path: Path, meta: dict | None = None) -> Path:
    model = {"conv1.w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    save_checkpoint(path, model, {"conv1.w": np.zeros((2, 3), np.float32)}, sound_meta() if meta is None else meta)
    return path


# ---- writing -----------------------------------------------------------------------------------
def test_round_trip(tmp_path):
    path = write(tmp_path / "c.npz")
    ck = read_checkpoint(path)
    assert np.array_equal(ck.model["conv1.w"], np.arange(6).reshape(2, 3)) and ck.optim["conv1.w"].shape == (2, 3)
    assert ck.meta["step"] == 5 and ck.meta["plan"]["counts"] == {"conv1": [2, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left


def test_a_save_is_fsynced_then_renamed_then_its_folder_fsynced(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", "folder" if os.path.isdir(f"/proc/self/fd/{fd}") else "file"))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", Path(src).parent == Path(dst).parent))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write(tmp_path / "c.npz")
    if Path("/proc/self/fd").is_dir():
        assert calls == [("fsync", "file"), ("replace", True), ("fsync", "folder")]
    else:
        assert [c[0] for c in calls] == ["fsync", "replace", "fsync"]


def test_a_failed_save_keeps_the_old_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    path = write(tmp_path / "c.npz")
    before = path.read_bytes()

    def broken_savez(f, **arrays):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        write(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_stale_temporaries_of_a_crashed_save_are_removed_at_the_next(tmp_path):
    stale = [tmp_path / ".c.npz.k2j4x9.tmp"]
    for p in stale:
        p.write_bytes(b"a save that never finished")
    other = tmp_path / ".d.npz.abc.tmp"  # another checkpoint's: not ours to remove
    other.write_bytes(b"")
    write(tmp_path / "c.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d.npz.abc.tmp", "c.npz"]


# ---- reading what cannot be resumed from --------------------------------------------------------------
def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        read_checkpoint(tmp_path / "missing.npz")
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        read_checkpoint(tmp_path / "empty.npz")
    (tmp_path / "garbage.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable tinyconv checkpoint: not an .npz archive") as info:
        read_checkpoint(tmp_path / "garbage.npz")
    assert "pickle" not in str(info.value)  # numpy's own message would suggest loading it unsafely


def test_every_truncation_is_a_clear_error(tmp_path):
    raw = write(tmp_path / "c.npz").read_bytes()
    cut = tmp_path / "cut.npz"
    for n in [1, 2, 10, 30, 100, *range(200, len(raw), 97), len(raw) - 22, len(raw) - 1]:
        cut.write_bytes(raw[:n])
        with pytest.raises(ValueError, match="not a readable tinyconv checkpoint|is damaged"):
            read_checkpoint(cut)


def test_corrupted_bytes_are_a_clear_error_or_harmless(tmp_path):
    """A flipped byte in the arrays or the meta fails the zip's CRC; one in a header field that
    nothing reads (a timestamp) changes nothing. Never another exception than ValueError."""
    path = write(tmp_path / "c.npz")
    raw = path.read_bytes()
    reference = read_checkpoint(path)
    bad = tmp_path / "bad.npz"
    rng = np.random.default_rng(7)
    refused = 0
    for pos in rng.choice(len(raw), size=120, replace=False):
        flipped = bytearray(raw)
        flipped[pos] ^= 0xFF
        bad.write_bytes(bytes(flipped))
        try:
            ck = read_checkpoint(bad)
        except ValueError as e:
            assert str(bad) in str(e)
            refused += 1
            continue
        assert ck.meta == reference.meta and np.array_equal(ck.model["conv1.w"], reference.model["conv1.w"])
    assert refused > 100


def test_a_zip_without_meta_and_pickled_arrays_are_refused(tmp_path):
    path = tmp_path / "nometa.npz"
    np.savez(path, **{"model/conv1.w": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="not a readable tinyconv checkpoint.*KeyError"):
        read_checkpoint(path)
    path = tmp_path / "pickled.npz"
    np.savez(path, meta=np.array([{"step": 1}], dtype=object))
    with pytest.raises(ValueError, match="not a readable tinyconv checkpoint"):
        read_checkpoint(path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("step", None, "no field 'step'"),
        ("augment_state", None, "no field 'augment_state'"),
        ("model_config", None, "no field 'model_config'"),
        ("step", "5", "'step' is '5' \\(str\\), not an int"),
        ("step", 5.0, "'step' is 5.0 \\(float\\), not an int"),
        ("step", True, "'step' is True \\(bool\\), not an int"),
        ("step", -1, "'step' is -1, below 0"),
        ("batch_in_epoch", [3], "not an int"),
        ("epoch_shuffle_state", {"bit_generator": "PCG64"}, "'epoch_shuffle_state' is not a generator state"),
        ("augment_state", "PCG64", "'augment_state' is 'PCG64' \\(str\\), not a dict"),
        ("model_config", {"arch": "4:8", "norm": "lrn"}, "no field 'model_config.pool_kernel'"),
        ("model_config", {"arch": 48, "norm": "lrn", "pool_kernel": 3}, "'model_config.arch' is 48"),
        ("train_config", {}, "no field 'train_config.batch_size'"),
        ("history", {}, "'history' is not a list"),
        ("plan", {"participants": ["master"], "counts": {"conv1": ["4"]}, "channel_counts": {}}, "'plan' is not"),
        ("plan", [1, 2], "'plan' is not a split"),
    ],
)
def test_missing_or_wrong_typed_meta_fields(tmp_path, field, value, message):
    meta = sound_meta()
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    path = write(tmp_path / "c.npz", meta)
    with pytest.raises(ValueError, match=message):
        read_checkpoint(path)


def test_another_format_is_refused(tmp_path):
    path = tmp_path / "c.npz"
    np.savez(path, meta=np.array(json.dumps({"format": "tinyconv-checkpoint-1", **sound_meta()})))
    with pytest.raises(ValueError, match="has format 'tinyconv-checkpoint-1'"):
        read_checkpoint(path)


def test_zip_errors_of_every_kind_become_value_errors(tmp_path, monkeypatch):
    path = write(tmp_path / "c.npz")
    for error in (zipfile.BadZipFile("Bad CRC-32"), EOFError("No data left"), NotImplementedError("compression")):

        def broken_load(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(ck.np, "load", broken_load)
        with pytest.raises(ValueError, match=type(error).__name__):
            read_checkpoint(path)


# ---- a checkpoint of another run -----------------------------------------------------------------------
def test_another_run_is_named_option_by_option():
    meta = sound_meta()
    here = {"arch": "4:8", "norm": "lrn", "pool_kernel": 3}
    check_compatible(meta, here, 32, "c.npz")  # the same run: fine
    with pytest.raises(ValueError) as info:
        check_compatible(meta, {"arch": "6:8", "norm": "batch", "pool_kernel": 2}, 64, "c.npz")
    text = str(info.value)
    for differs in ("--arch 4:8 there, 6:8 here", "--norm lrn there, batch here", "--pool 3 there, 2 here",
                    "--batch-size 32 there, 64 here"):  # fmt: skip
        assert differs in text
    assert "\n" not in text


def test_a_checkpoint_gets_the_usual_file_mode(tmp_path):
    old = os.umask(0o022)
    try:
        path = write(tmp_path / "c.npz")
    finally:
        os.umask(old)
    if os.name == "posix":
        assert path.stat().st_mode & 0o777 == 0o644  # as open() makes files: readable by others, like before
