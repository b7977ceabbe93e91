"""CIFAR-10 loader: tiny fixture files in the real format, a local HTTP server for downloads."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import pickle
import socket
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest

from tinyconv import cifar10
from tinyconv.cifar10 import DataError, load_cifar10

ROWS = 4  # images per fixture batch


# ---- fixture data -----------------------------------------------------------------


def _batch_dict(data: np.ndarray, labels: list[int], key_type=bytes) -> dict:
    k = (lambda s: s.encode()) if key_type is bytes else (lambda s: s)
    return {
        k("batch_label"): b"fixture batch",
        k("labels"): labels,
        k("data"): data,
        k("filenames"): [b"img_%d.png" % i for i in range(len(data))],
    }


def _write_pickle(path: Path, obj) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))  # the originals are protocol 2


def make_batches(folder: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Write data_batch_1..5, test_batch and batches.meta; return the expected NCHW arrays."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows, labels = {}, {}
    for name in cifar10.REQUIRED_FILES:
        rows[name] = rng.integers(0, 256, size=(ROWS, 3072), dtype=np.uint8)
        labels[name] = [int(v) for v in rng.integers(0, 10, size=ROWS)]
        _write_pickle(folder / name, _batch_dict(rows[name], labels[name]))
    meta = {b"label_names": [n.encode() for n in cifar10.LABEL_NAMES], b"num_cases_per_batch": ROWS}
    _write_pickle(folder / "batches.meta", meta)
    x_train = np.concatenate([rows[n] for n in cifar10.TRAIN_FILES]).reshape(-1, 3, 32, 32)
    y_train = np.array([v for n in cifar10.TRAIN_FILES for v in labels[n]], dtype=np.int64)
    x_test = rows["test_batch"].reshape(-1, 3, 32, 32)
    y_test = np.array(labels["test_batch"], dtype=np.int64)
    return x_train, y_train, x_test, y_test


def make_tarball(path: Path, seed: int = 0) -> tuple[tuple[np.ndarray, ...], str]:
    """A cifar-10-python.tar.gz look-alike; returns (expected arrays, its md5)."""
    src = path.parent / f"src-{seed}"
    expected = make_batches(src / cifar10.BATCHES_DIRNAME, seed)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src / cifar10.BATCHES_DIRNAME, arcname=cifar10.BATCHES_DIRNAME)
    return expected, hashlib.md5(path.read_bytes()).hexdigest()


def _assert_same(got, expected) -> None:
    for g, e, dtype in zip(got, expected, (np.uint8, np.int64, np.uint8, np.int64), strict=True):
        assert g.dtype == dtype
        np.testing.assert_array_equal(g, e)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def http_dir(tmp_path, monkeypatch):
    """A folder served over HTTP on 127.0.0.1; yields (base_url, folder)."""
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    folder = tmp_path / "served"
    folder.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", folder
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- loading ----------------------------------------------------------------------


def test_loads_fixture_in_nchw_order(tmp_path):
    expected = make_batches(tmp_path / cifar10.BATCHES_DIRNAME)
    got = load_cifar10(tmp_path, download=False, progress=False)
    x_train, y_train, x_test, y_test = got
    assert x_train.shape == (5 * ROWS, 3, 32, 32) and y_train.shape == (5 * ROWS,)
    assert x_test.shape == (ROWS, 3, 32, 32) and y_test.shape == (ROWS,)
    _assert_same(got, expected)
    # R, G, B planes of 32x32 row-major: row offset c*1024 + y*32 + x
    raw = pickle.loads((tmp_path / cifar10.BATCHES_DIRNAME / "data_batch_2").read_bytes(), encoding="bytes")
    assert x_train[ROWS + 1, 0, 0, 0] == raw[b"data"][1, 0]
    assert x_train[ROWS + 1, 2, 3, 5] == raw[b"data"][1, 2 * 1024 + 3 * 32 + 5]
    assert y_train[ROWS + 1] == raw[b"labels"][1]


def test_accepts_the_batches_folder_itself_and_str_keys(tmp_path):
    folder = tmp_path / cifar10.BATCHES_DIRNAME
    expected = make_batches(folder)
    data = expected[2].reshape(ROWS, 3072)
    _write_pickle(folder / "test_batch", _batch_dict(data, expected[3].tolist(), key_type=str))
    assert cifar10.find_batches_dir(folder) == folder
    assert cifar10.find_batches_dir(tmp_path) == folder
    _assert_same(load_cifar10(folder, download=False), expected)


def test_default_data_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYCONV_DATA", str(tmp_path / "here"))
    assert cifar10.default_data_dir() == tmp_path / "here"
    monkeypatch.delenv("TINYCONV_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cifar10.default_data_dir() == tmp_path / "cache" / "tinyconv"


def test_missing_data_without_download_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError) as err:
        load_cifar10(tmp_path / "nothing", download=False)
    msg = str(err.value)
    assert cifar10.OFFICIAL_URL in msg and cifar10.OFFICIAL_MD5 in msg
    assert "--data-dir" in msg and "TINYCONV_DATA" in msg


def test_incomplete_folder_is_refused_not_overwritten(tmp_path):
    folder = tmp_path / cifar10.BATCHES_DIRNAME
    make_batches(folder)
    (folder / "data_batch_4").unlink()
    with pytest.raises(DataError, match="incomplete: missing data_batch_4"):
        load_cifar10(tmp_path, download=True, url=f"http://127.0.0.1:{_closed_port()}/x")
    assert (folder / "data_batch_1").is_file()


def _valid_rows() -> np.ndarray:
    return np.zeros((ROWS, 3072), dtype=np.uint8)


BAD_BATCHES = {
    "truncated": lambda: pickle.dumps(_batch_dict(_valid_rows(), [0] * ROWS), protocol=2)[:5000],
    "garbage": lambda: b"this is not a pickle at all",
    "wrong shape": lambda: pickle.dumps(_batch_dict(np.zeros((ROWS, 3000), np.uint8), [0] * ROWS), protocol=2),
    "wrong dtype": lambda: pickle.dumps(_batch_dict(np.zeros((ROWS, 3072), np.float32), [0] * ROWS), protocol=2),
    "label out of range": lambda: pickle.dumps(_batch_dict(_valid_rows(), [0, 1, 10, 2]), protocol=2),
    "negative label": lambda: pickle.dumps(_batch_dict(_valid_rows(), [0, -1, 3, 2]), protocol=2),
    "label count": lambda: pickle.dumps(_batch_dict(_valid_rows(), [0, 1]), protocol=2),
    "float labels": lambda: pickle.dumps(_batch_dict(_valid_rows(), [0.5] * ROWS), protocol=2),
    "not a dict": lambda: pickle.dumps([1, 2, 3], protocol=2),
    "no keys": lambda: pickle.dumps({b"pixels": _valid_rows()}, protocol=2),
}
EXPECTED_MESSAGE = {
    "truncated": "truncated or corrupt",
    "garbage": "truncated or corrupt",
    "wrong shape": r"expected uint8 of shape \(N, 3072\)",
    "wrong dtype": "float32",
    "label out of range": r"labels range over \[0, 10\]",
    "negative label": r"labels range over \[-1, 3\]",
    "label count": "2 labels for 4 images",
    "float labels": "expected a list of ints",
    "not a dict": "holds a list",
    "no keys": "no 'data' and 'labels'",
}


@pytest.mark.parametrize("kind", sorted(BAD_BATCHES))
def test_malformed_batch_is_a_clear_data_error(tmp_path, kind):
    make_batches(tmp_path / cifar10.BATCHES_DIRNAME)
    bad = tmp_path / cifar10.BATCHES_DIRNAME / "data_batch_3"
    bad.write_bytes(BAD_BATCHES[kind]())
    with pytest.raises(DataError, match=EXPECTED_MESSAGE[kind]) as err:
        load_cifar10(tmp_path, download=False)
    assert "data_batch_3" in str(err.value) and "download" in str(err.value)


class _RunsCommand:
    """Pickles to ``os.system(cmd)``: the classic malicious payload."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        import os

        return (os.system, (self.cmd,))


def test_malicious_pickle_is_refused_and_not_executed(tmp_path):
    make_batches(tmp_path / cifar10.BATCHES_DIRNAME)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _RunsCommand(f"touch {marker}"), b"labels": [0]}, protocol=2)
    (tmp_path / cifar10.BATCHES_DIRNAME / "test_batch").write_bytes(payload)
    with pytest.raises(DataError, match=r"refusing to load the global (os|posix)\.system") as err:
        load_cifar10(tmp_path, download=False)
    assert "test_batch" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"cbuiltins\neval\n(S'1+1'\ntR.",  # protocol 0 GLOBAL
        b"csubprocess\nPopen\n((S'true'\nltR.",
        b"c__builtin__\ngetattr\n(cnumpy\nndarray\nS'tofile'\ntR.",  # a py2 name fix_imports would map
        pickle.dumps(np.ma.masked_array([1, 2]), protocol=2),  # an ndarray subclass
        pickle.dumps(np.array([1, None], dtype=object), protocol=2),  # object arrays carry objects
        # an allowed name put to another use: codecs.encode("abc", "rot13")
        b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x05\x00\x00\x00rot13\x86R.",
    ],
)
def test_restricted_unpickler_refuses_everything_but_plain_arrays(payload):
    with pytest.raises(DataError, match="refusing"):
        cifar10.safe_load_pickle(io.BytesIO(payload))


def test_restricted_unpickler_reads_arrays_of_both_numpy_spellings():
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    new = pickle.dumps({b"data": arr}, protocol=2)
    old = new.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")  # as numpy 1.x and the originals
    for blob in (new, old):
        got = cifar10.safe_load_pickle(io.BytesIO(blob))[b"data"]
        np.testing.assert_array_equal(got, arr)


# ---- downloading ------------------------------------------------------------------


def test_download_verifies_extracts_and_loads(tmp_path, http_dir):
    base, served = http_dir
    expected, md5 = make_tarball(served / cifar10.TARBALL_NAME)
    data_dir = tmp_path / "data"
    got = load_cifar10(data_dir, url=f"{base}/{cifar10.TARBALL_NAME}", md5=md5, progress=False, timeout=5)
    _assert_same(got, expected)
    assert (data_dir / cifar10.BATCHES_DIRNAME / "test_batch").is_file()
    assert (data_dir / cifar10.TARBALL_NAME).is_file()
    assert not (data_dir / (cifar10.TARBALL_NAME + ".part")).exists()
    assert sorted(p.name for p in data_dir.iterdir()) == sorted([cifar10.TARBALL_NAME, cifar10.BATCHES_DIRNAME])
    _assert_same(load_cifar10(data_dir, download=False), expected)  # now found locally


def test_wrong_checksum_deletes_the_file_and_says_so(tmp_path, http_dir):
    base, served = http_dir
    make_tarball(served / cifar10.TARBALL_NAME)
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match="checksum mismatch") as err:
        load_cifar10(data_dir, url=f"{base}/{cifar10.TARBALL_NAME}", md5="0" * 32, progress=False, timeout=5)
    assert "deleted" in str(err.value)
    assert list(data_dir.iterdir()) == []


@pytest.mark.parametrize("where", ["closed port", "missing file"])
def test_unreachable_download_is_a_data_error(tmp_path, http_dir, where):
    base, _ = http_dir
    url = f"http://127.0.0.1:{_closed_port()}/x" if where == "closed port" else f"{base}/nope.tar.gz"
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match="could not download") as err:
        load_cifar10(data_dir, url=url, progress=False, timeout=5)
    assert url in str(err.value) and "by hand" in str(err.value) and "--data-dir" in str(err.value)
    assert list(data_dir.iterdir()) == []


def test_a_tarball_already_in_place_is_used_without_network(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    expected, md5 = make_tarball(data_dir / cifar10.TARBALL_NAME)
    got = load_cifar10(data_dir, url=f"http://127.0.0.1:{_closed_port()}/x", md5=md5.upper(), progress=False)
    _assert_same(got, expected)


def _tar_with(path: Path, member: tarfile.TarInfo, content: bytes = b"") -> str:
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(member, io.BytesIO(content) if member.isfile() else None)
    return hashlib.md5(path.read_bytes()).hexdigest()


def _file_member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


def _link_member(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


UNSAFE_MEMBERS = {
    "dot-dot path": (lambda root: _file_member("../escaped", 3), "unsafe path"),
    "absolute path": (lambda root: _file_member(str(root / "escaped"), 3), "unsafe path"),
    "symlink": (
        lambda root: _link_member("cifar-10-batches-py/test_batch", "/etc/passwd"),
        "link or special",
    ),
    "no batches": (lambda root: _file_member("cifar-10-batches-py/readme.html", 3), "does not contain"),
}


@pytest.mark.parametrize("kind", sorted(UNSAFE_MEMBERS))
def test_unsafe_or_wrong_tarball_is_refused(tmp_path, http_dir, kind):
    base, served = http_dir
    make_member, message = UNSAFE_MEMBERS[kind]
    md5 = _tar_with(served / cifar10.TARBALL_NAME, make_member(tmp_path), b"abc")
    data_dir = tmp_path / "data"
    with pytest.raises(DataError, match=message):
        load_cifar10(data_dir, url=f"{base}/{cifar10.TARBALL_NAME}", md5=md5, progress=False, timeout=5)
    assert not (tmp_path / "escaped").exists()
    assert sorted(p.name for p in data_dir.iterdir()) == [cifar10.TARBALL_NAME]  # nothing extracted
