"""CURVE: key files, the refusal of a public bind without keys, and who gets in.

Real worker processes (``tests/echo_worker.py``) on loopback; each rogue's exit is what
the tests wait on, so nothing here sleeps.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from echo_worker import PROTOCOL, TIMEOUT, answer, reap, spawn

from transports.base import Message
from transports.curve import CurveClient, CurveServer, generate_keys, local_keys
from transports.endpoints import is_local
from transports.zmq_master import ZmqTransport
from transports.zmq_worker import EXIT_FAILED, EXIT_OK

LOCAL = "tcp://127.0.0.1:0"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---- keys ----------------------------------------------------------------------------------


def test_generate_keys_writes_a_private_pair_and_never_overwrites(tmp_path):
    where = tmp_path / "keys"
    public, secret = generate_keys(where, "alice")
    assert (public, secret) == (str(where / "alice.key"), str(where / "alice.key_secret"))
    assert mode(where) == 0o700 and mode(secret) == 0o600 and mode(public) == 0o644
    assert "secret-key" in open(secret).read() and "secret-key" not in open(public).read()
    assert sorted(os.listdir(where)) == ["alice.key", "alice.key_secret"]  # no scratch left behind
    with pytest.raises(FileExistsError, match="already exists"):
        generate_keys(where, "alice")
    with pytest.raises(ValueError, match="plain file name"):
        generate_keys(where, "../bob")


def test_local_keys_authorise_exactly_the_local_worker(tmp_path):
    server, client, files = local_keys(tmp_path / "run")
    assert mode(tmp_path / "run") == 0o700 and mode(files.authorized_dir) == 0o700
    assert mode(files.server_secret) == 0o600 and mode(files.worker_secret) == 0o600
    assert os.listdir(files.authorized_dir) == ["worker.key"]
    assert server.authorized == {client.public_key}
    assert (client.secret_key_file, client.server_public_key_file) == (files.worker_secret, files.server_public)
    again, client2, _ = local_keys(tmp_path / "run")  # fresh keys each time, the old ones gone
    assert again.authorized == {client2.public_key} != server.authorized
    assert "secret" not in repr(client).replace("key_secret", "")  # a repr shows file names, never a key


def test_key_files_are_checked_with_clear_errors(tmp_path):
    public, secret = generate_keys(tmp_path, "master")
    empty = tmp_path / "nobody"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no secret key; pass the NAME.key_secret file"):
        CurveServer(public, tmp_path)
    with pytest.raises(ValueError, match="holds no public keys.*no worker could ever join"):
        CurveServer(secret, empty)
    with pytest.raises(ValueError, match="cannot read the authorised worker keys"):
        CurveServer(secret, tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot read a CURVE key from .*`keygen` command"):
        CurveClient(tmp_path / "missing.key_secret", public)
    (tmp_path / "bad.key_secret").write_text('curve\n    public-key = "short"\n    secret-key = "short"\n')
    with pytest.raises(ValueError, match="malformed key"):
        CurveClient(tmp_path / "bad.key_secret", public)


# ---- who may bind where -------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, local",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/workers.sock", True),
        ("inproc://workers", True),
        ("tcp://*:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://192.168.1.20:5555", False),
        ("tcp://eth0:5555", False),
        ("pgm://eth0;239.192.1.1:5555", False),
    ],
)
def test_which_addresses_are_local(address, local):
    assert is_local(address) is local


def test_a_public_bind_without_keys_is_refused_unless_insecure(tmp_path):
    with pytest.raises(ValueError) as info:
        ZmqTransport(bind="tcp://*:0", protocol=PROTOCOL)
    text = str(info.value)
    assert text.startswith("binding tcp://*:0 without CURVE keys would let any process")
    assert "training batches and weights" in text and "poisoned results" in text
    assert "`keygen` command" in text and "insecure=True (--insecure)" in text
    with ZmqTransport(bind="tcp://0.0.0.0:0", protocol=PROTOCOL, insecure=True) as t:  # the risk, accepted
        assert not t.secured
    server, _, _ = local_keys(tmp_path)
    with ZmqTransport(bind="tcp://*:0", protocol=PROTOCOL, curve=server) as t:
        assert t.secured
    with pytest.raises(TypeError, match="CurveServer"):
        ZmqTransport(bind=LOCAL, protocol=PROTOCOL, curve="keys/master.key_secret")


# ---- admission ---------------------------------------------------------------------------


def test_curve_admits_the_authorised_worker_and_never_a_rogue(tmp_path, caplog):
    server, _, files = local_keys(tmp_path / "master")
    _, stranger_secret = generate_keys(tmp_path / "stranger", "rogue")
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL, curve=server) as t:
        address = t.bound_address
        rogues = [
            spawn(address),  # no keys at all
            spawn(address, "--secret-key", stranger_secret, "--server-key", files.server_public),  # unknown key
            spawn(address, "--secret-key", files.worker_secret, "--server-key", files.worker_public),  # wrong master
        ]
        good = spawn(address, "--secret-key", files.worker_secret, "--server-key", files.server_public)
        try:
            (info,) = t.start(1, timeout=TIMEOUT)
            assert info.pid == good.pid and info.address == "127.0.0.1"
            assert info.key == open(files.worker_public).read().split('public-key = "')[1][:40]  # its NAME.key's
            t.send(0, Message("echo", {"task": 1}, {"x": np.arange(4, dtype=np.float32)}))
            k, reply = answer(t)  # tasks and results cross encrypted, like any other
            np.testing.assert_array_equal(reply.arrays["y"], np.arange(4) * 2 + 1)
            errs = [p.communicate(timeout=TIMEOUT)[1] for p in rogues]  # each rogue gives up by itself
            assert [p.returncode for p in rogues] == [EXIT_FAILED] * 3
            assert all(e.startswith("echo worker: cannot join: ") for e in errs)
            assert "requires CURVE keys" in errs[0]  # (zmq tells it at once, or after a few tries)
            assert "refused this worker's key" in errs[1] and "not among the master's authorised keys" in errs[1]
            assert f"perhaps {files.worker_public} is not the master's public key" in errs[2]
            assert all("Traceback" not in e for e in errs)
            refused = [r.getMessage() for r in caplog.records if "key not authorised" in r.getMessage()]
            assert refused and "from 127.0.0.1" in refused[0]  # the master says who knocked, rate-limited
            assert t.joined() == [] and list(t.traffic()) == [0]  # no rogue ever got a slot
            t.close()
            _, err = good.communicate(timeout=TIMEOUT)
            assert good.returncode == EXIT_OK and "shutdown: train over" in err
        finally:
            reap([*rogues, good])


def test_a_worker_with_keys_is_told_when_the_master_has_none(tmp_path):
    _, _, files = local_keys(tmp_path)
    with ZmqTransport(bind=LOCAL, protocol=PROTOCOL) as t:
        proc = spawn(t.bound_address, "--secret-key", files.worker_secret, "--server-key", files.server_public)
        try:
            _, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == EXIT_FAILED
            assert "cannot join: " in err and "does not use CURVE keys" in err
        finally:
            reap([proc])
