"""CURVE: who may be a worker, and nobody else reads the traffic (docs/writing-a-transport.md, "Across machines:
CURVE keys"). All crypto is ZeroMQ's (``zmq.auth``); a peer without an authorised key fails ZeroMQ's handshake.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

PathLike = str | os.PathLike
_PRIVATE_DIR = 0o700
_PRIVATE_FILE = 0o600
_PUBLIC_FILE = 0o644


def _write_key_pair(directory: Path, name: str, overwrite: bool) -> tuple[str, str]:
    """zmq.auth.create_certificates in a private scratch directory, then moved into place, so that
    the secret file is never readable by others, not even for a moment."""
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name.startswith("."):
        raise ValueError(f"a key name must be a plain file name, got {name!r}")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not overwrite and (public.exists() or secret.exists()):
        raise FileExistsError(f"{public} or {secret} already exists; remove both first to make a new key pair")
    scratch = Path(tempfile.mkdtemp(prefix=".keygen-", dir=directory))  # mkdtemp: mode 0700
    try:
        made_public, made_secret = zmq.auth.create_certificates(scratch, name)
        os.chmod(made_secret, _PRIVATE_FILE)
        os.chmod(made_public, _PUBLIC_FILE)
        os.replace(made_secret, secret)
        os.replace(made_public, public)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(public), str(secret)


def generate_keys(directory: PathLike, name: str) -> tuple[str, str]:
    """Write a new key pair, ``directory/NAME.key`` and ``NAME.key_secret``; (public_path, secret_path).
    A missing ``directory`` is made mode 0700; existing key files are never overwritten (FileExistsError)."""
    directory = Path(directory)
    directory.mkdir(mode=_PRIVATE_DIR, parents=True, exist_ok=True)
    return _write_key_pair(directory, name, overwrite=False)


def _load_key_file(path: PathLike, secret: bool) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) from a key file, with errors that say which file and what to do."""
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        hint = "make key files with the `keygen` command (transports.curve.generate_keys)"
        raise ValueError(f"cannot read a CURVE key from {path}: {e}; {hint}") from e
    if secret and secret_key is None:
        raise ValueError(f"{path} holds no secret key; pass the NAME.key_secret file, not the public NAME.key")
    try:
        for key in filter(None, (public, secret_key)):
            if len(key) != 40:
                raise ValueError(f"{len(key)} characters")
            z85.decode(key)
    except (ValueError, KeyError, IndexError, TypeError):  # z85.decode's, for a character outside Z85
        raise ValueError(f"{path} holds a malformed key (a CURVE key is 40 Z85 characters)") from None
    return public, secret_key


class CurveServer:
    """The master's side: its secret key file, and the directory of the public keys (``*.key``) it admits,
    read once: a key added later needs a new transport."""

    def __init__(self, secret_key_file: PathLike, authorized_keys_dir: PathLike) -> None:
        self.secret_key_file = str(secret_key_file)  # its public key file is beside it, with the suffix .key
        self.authorized_keys_dir = str(authorized_keys_dir)
        self.public_key, self._secret_key = _load_key_file(secret_key_file, secret=True)
        try:
            allowed = zmq.auth.load_certificates(self.authorized_keys_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the authorised worker keys in {self.authorized_keys_dir}: {e}") from e
        if not allowed:
            raise ValueError(
                f"{self.authorized_keys_dir} holds no public keys (*.key), so no worker could ever join; "
                "copy each worker's NAME.key there"
            )
        self.authorized = frozenset(allowed)

    def apply(self, ctx: zmq.Context, sock: zmq.Socket) -> ThreadAuthenticator:
        """Start ``ctx``'s authenticator, which admits only the authorised keys, and make ``sock`` a
        CURVE server. Returns the authenticator: ``stop()`` it before terminating ``ctx``."""
        auth = ReportingAuthenticator(ctx)
        auth.start()
        auth.configure_curve(domain="*", location=self.authorized_keys_dir)
        sock.curve_secretkey = self._secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True
        return auth


class ReportingAuthenticator(ThreadAuthenticator):
    """ZeroMQ's authenticator, which also tells ``on_refused(address, why)`` of each attempt it turns away
    (a key not authorised, say): such a peer never reaches the transport, so only here can it be reported."""

    on_refused: Callable[[str, str], None] | None = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"  # ZAP: version, id, domain, address
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes, *rest: str) -> None:
        if status_code != b"200" and self.on_refused is not None:
            self.on_refused(getattr(self, "_address", "?"), status_text.decode("utf-8", "replace"))
        super()._send_zap_reply(request_id, status_code, status_text, *rest)


class CurveClient:
    """A worker's side: its own secret key file, and the master's public key file."""

    def __init__(self, secret_key_file: PathLike, server_public_key_file: PathLike) -> None:
        self.secret_key_file = str(secret_key_file)
        self.server_public_key_file = str(server_public_key_file)
        self.public_key, self._secret_key = _load_key_file(secret_key_file, secret=True)
        self.server_key, _ = _load_key_file(server_public_key_file, secret=False)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (a DEALER, before it connects) a CURVE client of the master."""
        sock.curve_secretkey = self._secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.server_key

    def __repr__(self) -> str:
        return f"CurveClient({self.secret_key_file!r}, {self.server_public_key_file!r})"


class KeyFiles(NamedTuple):
    """Where :func:`local_keys` wrote the keys. A local worker needs ``worker_secret`` and ``server_public``."""

    server_public: str
    server_secret: str
    worker_public: str
    worker_secret: str
    authorized_dir: str


def local_keys(directory: PathLike) -> tuple[CurveServer, CurveClient, KeyFiles]:
    """A fresh key pair for a master (``master.key``, ``master.key_secret``) and one for the workers it starts
    on its own machine (``worker.key``, ``worker.key_secret``) in ``directory`` (made or set mode 0700; keys
    already there are replaced), with the worker's public key the only one in ``directory/authorized``."""
    directory = Path(directory)
    directory.mkdir(mode=_PRIVATE_DIR, parents=True, exist_ok=True)
    os.chmod(directory, _PRIVATE_DIR)
    server_public, server_secret = _write_key_pair(directory, "master", overwrite=True)
    worker_public, worker_secret = _write_key_pair(directory, "worker", overwrite=True)
    authorized = directory / "authorized"
    authorized.mkdir(mode=_PRIVATE_DIR, exist_ok=True)
    os.chmod(authorized, _PRIVATE_DIR)
    for old in authorized.glob("*.key"):
        old.unlink()
    shutil.copyfile(worker_public, authorized / "worker.key")
    files = KeyFiles(server_public, server_secret, worker_public, worker_secret, str(authorized))
    return CurveServer(server_secret, authorized), CurveClient(worker_secret, server_public), files
