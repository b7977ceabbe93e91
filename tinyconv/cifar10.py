"""The real CIFAR-10, read from its canonical python format: ``cifar-10-python.tar.gz`` unpacks to
``cifar-10-batches-py/``, data_batch_1 ... data_batch_5 (50000 training images, 10000 a file) and
test_batch (10000 test images).

Each batch is a Python-2 pickle (protocol 2) of a dict with ``b"data"``, a uint8 array (N, 3072) holding
the R, G and B planes in that order, each 32x32 row-major (so ``reshape(N, 3, 32, 32)`` is already NCHW),
and ``b"labels"``, a list of N ints in [0, 10).

Pickles can run arbitrary code when loaded, so the batches are read with a restricted unpickler that only
rebuilds numpy arrays. Every problem (missing files, no network, bad checksum, corrupt file) is a
``DataError`` whose message says what was wrong and what to do: a command prints it, no traceback.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from tinyconv.story import hide_bars

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct

OFFICIAL_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
OFFICIAL_MD5 = "c58f30108f718f92721af3b95e74349a"
LABEL_NAMES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip
TARBALL_NAME = "cifar-10-python.tar.gz"
BATCHES_DIRNAME = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
REQUIRED_FILES = (*TRAIN_FILES, TEST_FILE)
IMAGE_SHAPE = (3, 32, 32)
ROW_SIZE = 3 * 32 * 32  # 3072 bytes per image
NUM_CLASSES = len(LABEL_NAMES)


class DataError(Exception):
    """The data set is missing, unreachable or corrupt. ``str(err)`` says what to do."""


# ---- where the data lives -------------------------------------------------------
def default_data_dir() -> Path:
    """``$TINYCONV_DATA`` if set, else ``$XDG_CACHE_HOME/tinyconv``, else ``~/.cache/tinyconv``."""
    env = os.environ.get("TINYCONV_DATA", "").strip()
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and Path(xdg).is_absolute():  # the XDG spec says to ignore relative paths
        return Path(xdg) / "tinyconv"
    return Path.home() / ".cache" / "tinyconv"


def find_batches_dir(data_dir: Path | str) -> Path | None:
    """The folder holding all the batches, ``data_dir`` or ``data_dir/cifar-10-batches-py``; None if neither."""
    root = Path(data_dir).expanduser()
    for candidate in (root, root / BATCHES_DIRNAME):
        if all((candidate / name).is_file() for name in REQUIRED_FILES):
            return candidate
    return None


def _how_to_get(root: Path, url: str, md5: str) -> str:
    return (
        f"To get it: download {TARBALL_NAME} by hand from {url}, check that its md5 is {md5}, "
        f"and extract it into {root} (giving {root / BATCHES_DIRNAME}/); "
        f"or, if you already have it elsewhere, pass --data-dir / set TINYCONV_DATA to that folder."
    )


def _check_not_partial(root: Path, url: str, md5: str) -> None:
    """Refuse a half-present batches folder rather than mixing or overwriting files."""
    for candidate in (root, root / BATCHES_DIRNAME):
        present = [n for n in REQUIRED_FILES if (candidate / n).exists()]
        if present:
            missing = [n for n in REQUIRED_FILES if n not in present]
            raise DataError(
                f"CIFAR-10 in {candidate} is incomplete: missing {', '.join(missing)}. "
                f"Delete {candidate} (or complete it) and run again. " + _how_to_get(root, url, md5)
            )


# ---- download and extract -------------------------------------------------------
def _md5_of_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, dest: Path, progress: bool, timeout: float) -> None:
    """Stream ``url`` into ``dest``; ``timeout`` (s) bounds the connection and every read: no hang on a stall."""
    with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as out:
        total = response.headers.get("Content-Length")
        bar = tqdm(
            total=int(total) if total and total.isdigit() else None,
            unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"downloading {TARBALL_NAME}", disable=hide_bars(progress),
        )  # fmt: skip
        with bar:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                out.write(chunk)
                bar.update(len(chunk))


def _fetch_tarball(root: Path, url: str, md5: str, progress: bool, timeout: float) -> Path:
    """``root/cifar-10-python.tar.gz`` with the right md5, downloading it if needed."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the data folder {root}: {err}. Pass --data-dir / set TINYCONV_DATA to a writable folder."
        ) from None
    md5 = md5.strip().lower()
    tarball = root / TARBALL_NAME
    if tarball.is_file() and _md5_of_file(tarball) == md5:
        return tarball  # a complete earlier (or manual) download
    part = root / (TARBALL_NAME + ".part")
    try:
        _download(url, part, progress, timeout)
        got = _md5_of_file(part)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
        # offline, refused, timed out, HTTP error, cut short, bad url, or the disk is full
        part.unlink(missing_ok=True)
        reason = getattr(err, "reason", None) or err
        raise DataError(
            f"could not download CIFAR-10 from {url} to {part}: {reason}. "
            f"Check your network connection (and free disk space) and run again. " + _how_to_get(root, url, md5)
        ) from None
    if got != md5:
        part.unlink(missing_ok=True)
        raise DataError(
            f"checksum mismatch: the file downloaded from {url} has md5 {got}, expected {md5}; "
            f"the bad file was deleted. Run again to retry. " + _how_to_get(root, url, md5)
        )
    os.replace(part, tarball)
    return tarball


def _check_member(member: tarfile.TarInfo, tarball: Path) -> None:
    """Only plain files and folders with relative paths inside the destination."""
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts or member.name.startswith(("/", "\\")):
        raise DataError(f"{tarball} has an unsafe path {member.name!r}; delete it and download it again.")
    if not (member.isfile() or member.isdir()):
        raise DataError(
            f"{tarball} has {member.name!r}, which is a link or special file; delete it and download it again."
        )


def _extract(tarball: Path, root: Path) -> Path:
    """Safely extract ``tarball`` and move its batches folder to ``root/cifar-10-batches-py``."""
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
    try:
        try:
            with tarfile.open(tarball, "r:gz") as tar:
                members = tar.getmembers()
                for member in members:
                    _check_member(member, tarball)
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, members=members, filter="data")
                else:  # older Pythons: the manual check above is the guard
                    tar.extractall(tmp, members=members)
        except (tarfile.TarError, EOFError, OSError) as err:
            raise DataError(f"could not extract {tarball}: {err}. Delete it and download it again.") from None
        found = find_batches_dir(tmp)
        if found is None:
            raise DataError(
                f"{tarball} does not contain {BATCHES_DIRNAME}/ with {', '.join(REQUIRED_FILES)}; "
                f"it is not the python version of CIFAR-10. Delete it and download {TARBALL_NAME}."
            )
        target = root / BATCHES_DIRNAME
        os.replace(found, target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- safe loading ---------------------------------------------------------------
def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's pickle entry point for arrays, limited to plain ndarrays."""
    if subtype is not np.ndarray:
        raise DataError(f"refusing to rebuild an array of type {subtype!r}")
    return _np_reconstruct(np.ndarray, shape, dtype)


def _dtype(spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
    """``numpy.dtype`` as pickles call it, refusing object dtypes (they carry objects)."""
    dt = np.dtype(spec, bool(align), bool(copy))
    if dt.hasobject:
        raise DataError("refusing an object dtype")
    return dt


def _latin1_encode(text: Any, encoding: str = "latin1") -> bytes:
    """``codecs.encode`` as Python 3 protocol-2 pickles use it to store bytes."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise DataError(f"refusing codecs.encode({type(text).__name__}, {encoding!r})")
    return text.encode("latin1")


_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1_encode,
    ("codecs", "encode"): _latin1_encode,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler that can rebuild numpy arrays and plain containers, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise DataError(f"refusing to load the global {module}.{name}") from None


def safe_load_pickle(f: BinaryIO) -> Any:
    """Unpickle a CIFAR-10 file: plain containers, bytes, numbers and numpy arrays only."""
    return _RestrictedUnpickler(f, encoding="bytes").load()


def load_batch(path: Path | str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (data uint8 (N, 3072), labels int64 (N,)), validated."""
    path = Path(path)
    redo = "Delete it and download CIFAR-10 again (see --data-dir / TINYCONV_DATA)."
    try:
        with open(path, "rb") as f:
            batch = safe_load_pickle(f)
    except DataError as err:
        raise DataError(f"{path} is not a CIFAR-10 batch: {err}. {redo}") from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from None
    except Exception as err:  # untrusted bytes: any failure inside the unpickler means a bad file
        raise DataError(f"{path} is truncated or corrupt ({type(err).__name__}: {err}). {redo}") from None

    if not isinstance(batch, dict):
        raise DataError(f"{path} holds a {type(batch).__name__}, not the dict of a CIFAR-10 batch. {redo}")
    # b"data", or "data" in a pickle written with str keys
    data, labels = (batch.get(key.encode(), batch.get(key)) for key in ("data", "labels"))
    if data is None or labels is None:
        raise DataError(f"{path} has no 'data' and 'labels' entries. {redo}")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != ROW_SIZE:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' is {desc}, expected uint8 of shape (N, {ROW_SIZE}). {redo}")
    if data.shape[0] == 0:
        raise DataError(f"{path}: 'data' has no images. {redo}")
    try:
        labels = np.asarray(labels)
    except (ValueError, TypeError) as err:
        raise DataError(f"{path}: 'labels' is not a list of ints ({err}). {redo}") from None
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        raise DataError(f"{path}: 'labels' is {labels.dtype} {labels.shape}, expected a list of ints. {redo}")
    if len(labels) != len(data):
        raise DataError(f"{path}: {len(labels)} labels for {len(data)} images. {redo}")
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise DataError(
            f"{path}: labels range over [{labels.min()}, {labels.max()}], expected [0, {NUM_CLASSES}). {redo}"
        )
    return data, labels.astype(np.int64)


def _load_split(batches_dir: Path, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    parts = [load_batch(batches_dir / name) for name in names]
    x = np.concatenate([d for d, _ in parts]).reshape(-1, *IMAGE_SHAPE)  # R, G, B planes -> NCHW
    y = np.concatenate([lab for _, lab in parts])
    return x, y


def load_cifar10(
    data_dir: Path | str | None = None,
    download: bool = True,
    url: str = OFFICIAL_URL,
    md5: str = OFFICIAL_MD5,
    progress: bool = True,
    timeout: float = 60.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """CIFAR-10 as x_train uint8 (50000, 3, 32, 32) NCHW, y_train int64 (50000,), x_test uint8 (10000, 3, 32,
    32), y_test int64 (10000,), from ``data_dir`` (default ``default_data_dir()``): the batches' folder or
    one containing it. If they are missing and ``download`` is true, the tarball is downloaded from
    ``url``, checked against ``md5`` and extracted there. Never substitutes other data.
    """
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    if root.exists() and not root.is_dir():
        raise DataError(f"the data folder {root} is a file; pass --data-dir / set TINYCONV_DATA to a folder.")
    batches_dir = find_batches_dir(root)
    if batches_dir is None:
        _check_not_partial(root, url, md5)
        if not download:
            raise DataError(f"CIFAR-10 was not found in {root} and downloading is off. " + _how_to_get(root, url, md5))
        batches_dir = _extract(_fetch_tarball(root, url, md5, progress, timeout), root)
    x_train, y_train = _load_split(batches_dir, TRAIN_FILES)
    x_test, y_test = _load_split(batches_dir, (TEST_FILE,))
    return x_train, y_train, x_test, y_test
