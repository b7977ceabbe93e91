"""The master's pool of workers: starting them, stopping them, and :func:`distribute`.

    import tinyconv as tc
    net = tc.paper_net("50:500")
    with tc.distribute(net, transport="zmq", workers=2) as cluster:   # two local worker processes
        loss, logits = cluster.train_batch(net, x, y)                # the convolutions run in shards
        print(cluster.last_step["shares"])

:func:`worker_pool` is a context manager, so the workers go away whatever happens (a finished run,
an exception, Ctrl-C): no orphans, no ports left bound.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from subprocess import PIPE
from typing import Any

from backends import get_backend
from tinyconv.distributed.adaptive_precision import policy
from tinyconv.distributed.conv_shapes import conv_shapes
from tinyconv.distributed.protocol import VERSION
from tinyconv.distributed.replica.hybrid import Hybrid
from tinyconv.distributed.replica.server import Replicas, replica_message_bytes
from tinyconv.distributed.runtime import Runtime
from tinyconv.distributed.shard.cluster import Cluster
from tinyconv.distributed.worker.handler import Worker
from tinyconv.model import Network
from transports import get_transport
from transports.base import Transport, WorkerInfo
from transports.curve import CurveServer, KeyFiles, local_keys
from transports.endpoints import connect_hint, is_local
from transports.session.settings import SECRET_ENV
from transports.wire import DEFAULT_MAX_BYTES

DEFAULT_PUBLIC_BIND = "tcp://*:5555"
LOCAL_BIND = "tcp://127.0.0.1:0"  # a free port on loopback, for workers this process starts
WATCH_S = 0.05  # how often the master looks at its local worker processes while it waits for hellos
PARALLEL: dict[str, type[Runtime]] = {"model": Cluster, "data": Replicas, "hybrid": Hybrid}
MODEL_ONLY = ("split", "fuse", "pipeline", "wire_precision")  # options of the model split alone
# distribute()'s options that go to worker_pool()
POOL_OPTIONS = (
    "worker_device bind external worker_threads start_timeout peer_timeout key authorized_keys insecure".split()
)


def distribute(
    net: Network,
    transport: str = "inproc",
    workers: int = 2,
    *,
    parallel: str = "model",
    worker_backend: str | None = None,
    batch_size: int = 64,
    largest_batch: int | None = None,
    image_size: int = 32,
    calibrate: bool = True,
    announce: Callable[[str], None] = print,
    **options: Any,
) -> Runtime:
    """Start ``workers`` workers over ``transport`` ("inproc" threads, or "zmq" processes -- with
    ``external``, on other machines) and share ``net``'s training with them and the master.

    ``parallel``: "model" -- the paper's split: each convolution's kernels (:class:`Cluster`, which
    puts a ShardedBlock in the network for each); "data" -- each batch by images among whole
    replicas (``replica/server.py``); "hybrid" -- the convolutions by images, the classifier on the
    master (``replica/hybrid.py``). All three train with ``train_batch``, and report alike.

    ``worker_backend`` defaults to the master's. ``calibrate``: time everyone on ``batch_size``
    images of ``image_size`` pixels and split by eq. 1; otherwise start from an equal split.
    A message may carry no more than a step at ``largest_batch`` calls for (the largest batch the
    network will be given, evaluation's say; default ``batch_size``): a bigger one is refused.
    ``options``: the pool's (:data:`POOL_OPTIONS`: worker_device to insecure, :func:`worker_pool`'s), and
    the runtime's: master_share, rebalance, rebalancer, recv_timeout, calibration_repeats, spot_check for
    all three; split, fuse, pipeline, wire_precision (``adaptive_precision.py``) for the model split alone.
    Returns the runtime; ``close()`` it, or use it in a ``with`` block.
    """
    pool_options = {k: options.pop(k) for k in POOL_OPTIONS if k in options}
    _check_options(parallel, options)  # before any worker starts
    cap = message_cap(net, max(batch_size, largest_batch or 0), image_size, parallel)  # checked before arrays are built
    with ExitStack() as stack:  # stops the workers if anything below fails
        backend = worker_backend or net.backend.name
        pool = worker_pool(transport, workers, backend, max_message_bytes=cap, announce=announce, **pool_options)
        pool, infos = stack.enter_context(pool)
        runtime = PARALLEL[parallel](pool, infos, net.backend, image_size=image_size, **options)
        if calibrate:
            runtime.calibrate(net, batch_size)
        elif isinstance(runtime, Cluster):
            runtime.attach(net)
        runtime.on_close = stack.pop_all().close
    return runtime


def _check_options(parallel: str, options: dict[str, Any]) -> None:
    """ValueError for a parallelism there is none of, or an option it does not take."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    only_model = sorted(set(options) & set(MODEL_ONLY))
    if parallel != "model" and only_model:
        raise ValueError(f"{', '.join(only_model)}: for parallel='model' only, not {parallel!r}")
    policy(options.get("wire_precision", "fp32"))  # raises ValueError naming the settings


def message_cap(net: Network, batch_size: int, image_size: int, parallel: str = "model") -> int:
    """The most bytes a task or result may carry at ``batch_size``, at least 1 MiB. Of a sharded layer, one layer's
    x, two of its conv outputs (p_lo and p_hi may overlap), its weights and biases (the tails only shrink the maps,
    the halos only widen a slice to at most F); for the splits of the batch, twice the larger of that and a
    replica's weights and slices."""
    convs = conv_shapes(net, batch_size, image_size)
    biggest = max((math.prod(c.x) + 2 * math.prod(c.y) + math.prod(c.w) + c.w[0] for c in convs), default=0)
    cap = max(1 << 20, 4 * biggest)
    return cap if parallel == "model" else 2 * max(replica_message_bytes(net, batch_size, image_size), cap)


@contextmanager
def worker_pool(
    transport: str,
    n_workers: int,
    worker_backend: str = "numpy",
    worker_device: str | None = None,
    bind: str | None = None,
    external: bool = False,
    worker_threads: int | None = None,
    start_timeout: float = 60.0,
    peer_timeout: float = 30.0,
    key: str | None = None,
    authorized_keys: str | None = None,
    insecure: bool = False,
    max_message_bytes: int = DEFAULT_MAX_BYTES,
    announce: Callable[[str], None] = print,
) -> Iterator[tuple[Transport, list[WorkerInfo]]]:
    """Yield (transport, the workers' hellos) for ``n_workers`` >= 1 workers.

    transport "inproc": ``n_workers`` threads, each with its own ``worker_backend``. "mpi": the
    ranks 1..n_workers that ``mpiexec`` started beside this one (rank 0). Any other (zmq, or one
    registered by another package): the master binds ``bind`` (default: a free loopback port for
    local workers, ``tcp://*:5555`` with ``external``); without ``external`` it starts ``n_workers``
    worker processes here, with ``external`` it announces the command to run on the other machines
    and waits for them. A peer silent beyond its patience (``peer_timeout`` s at most) is gone, on both sides.

    Who may join (README, "Across machines"): beyond loopback, the holders of CURVE keys (:func:`_keys`: the master's
    ``key`` file, the folder of the workers' public ``authorized_keys``) unless ``insecure``; else a per-run secret
    ($TINYCONV_JOIN_SECRET if set: workers rejoin a resumed master), in the workers' environment and the command.
    """
    if n_workers < 1:
        raise ValueError(f"a pool needs at least one worker, got {n_workers}")
    stack, keys, secret = ExitStack(), None, None  # the temporary key folder of local workers, if any
    pool = _in_process(transport, worker_backend, worker_device, external, peer_timeout, max_message_bytes)
    bound = pool is None  # the master binds an address that workers connect to
    if bound:
        address = bind or (DEFAULT_PUBLIC_BIND if external else LOCAL_BIND)
        keys = _keys(address, external, key, authorized_keys, insecure, stack)
        secret = None if insecure or (external and keys) else os.environ.get(SECRET_ENV) or secrets.token_hex(16)
        options = {"curve": keys[0] if keys else None, "insecure": insecure, "secret": secret}
        pool = get_transport(transport, bind=address, peer_timeout_s=peer_timeout, protocol=VERSION,
                             max_message_bytes=max_message_bytes, **options)  # fmt: skip
    procs, command = [], ""  # local worker processes; how a worker joins this master, for the messages
    try:
        if bound:
            command = _worker_command(connect_hint(pool.bound_address), worker_backend, keys, external, secret)
        if external:
            announce(f"waiting for {n_workers} worker(s); on each worker machine run:\n    {command}")
        elif bound:
            extra = _local_worker_args(worker_device, peer_timeout, keys)
            connect = pool.bound_address.replace("0.0.0.0", "127.0.0.1")
            env = {SECRET_ENV: secret} if secret else {}
            procs = spawn_local_workers(n_workers, connect, worker_backend, extra, worker_threads, PIPE, env)
        yield pool, _handshake(pool, n_workers, start_timeout, procs, command)
    finally:
        pool.close()
        stack.close()
        if procs:
            codes = stop_workers(procs)
            if any(c not in (0, None) for c in codes):
                print(f"note: local workers exited with codes {codes}", file=sys.stderr)


def _in_process(
    transport: str, backend: str, device: str | None, external: bool, peer_timeout: float, max_bytes: int
) -> Transport | None:
    """The master's end of "inproc" (its workers: threads here, each with its own ``backend``) or "mpi"
    (the other ranks mpiexec started, ``transports/mpi_worker.py``); None for a transport that binds."""
    if transport not in ("inproc", "mpi"):
        return None
    if external:
        raise ValueError(
            "--external-workers needs --transport zmq: in-process workers are threads here"
            if transport == "inproc"
            else "--external-workers is for zmq: under mpi the workers are the ranks mpiexec started"
        )
    if transport == "mpi":
        return get_transport("mpi", peer_timeout_s=peer_timeout, protocol=VERSION, max_message_bytes=max_bytes)
    options = {"device": device} if device else {}
    return get_transport("inproc", handler_factory=lambda i: Worker(get_backend(backend, **options)), protocol=VERSION)


def _local_worker_args(device: str | None, peer_timeout: float, keys: tuple | None) -> list[str]:
    """The options of a local worker process: its device, its timeouts, its keys if the bind needs them.
    It outlives a master that dies by no more than one more peer timeout."""
    args = (["--device", device] if device else []) + ["--peer-timeout", str(peer_timeout)]
    args += ["--retry-for", str(peer_timeout)]
    return args + (["--key", keys[1].worker_secret, "--master-key", keys[1].server_public] if keys else [])


def _keys(
    bind: str, external: bool, key: str | None, authorized: str | None, insecure: bool, stack: ExitStack
) -> tuple[CurveServer, KeyFiles | None] | None:
    """The CURVE keys of a master at ``bind``: for external workers the user's (``key``,
    ``authorized``), for local workers on a bind beyond loopback a fresh pair in a private
    temporary folder (removed by ``stack``); None on loopback, or with ``insecure``."""
    if (key is None) != (authorized is None):
        raise ValueError("--key and --authorized-keys go together: the master's secret key, its workers' public keys")
    if key is not None and not external:
        raise ValueError("--key and --authorized-keys are for --external-workers: local workers get keys of their own")
    if key is not None:
        return CurveServer(key, authorized), None
    if external and not (insecure or is_local(bind)):
        raise ValueError(
            f"binding {bind} without keys would let any process that reaches this machine join as a worker, "
            "read the batches and weights and send poisoned results: make key pairs with `tinyconv keygen` and "
            "give --key and --authorized-keys (README, 'Across machines'), bind a loopback address, or accept "
            "the risk with --insecure"
        )
    if external or insecure or is_local(bind):
        return None
    server, _, files = local_keys(stack.enter_context(tempfile.TemporaryDirectory(prefix="tinyconv-keys-")))
    return server, files


def _worker_command(connect: str, backend: str, keys: tuple | None, external: bool, secret: str | None) -> str:
    """How a worker joins: the command to run on its machine (with the run's join secret, if it has one)."""
    command = (f"{SECRET_ENV}={secret} " if external and secret else "") + f"tinyconv worker --connect {connect}"
    command += f" --backend {backend}"
    if keys and external:
        master_public = str(Path(keys[0].secret_key_file).with_suffix(".key"))
        command += f" --key <its NAME.key_secret> --master-key {master_public}"
    return command


def _handshake(
    pool: Transport, n: int, timeout: float, procs: list[subprocess.Popen], command: str
) -> list[WorkerInfo]:
    """Every worker's hello; a timeout says how a worker joins. With local worker processes, ``pool.start``
    runs in a thread (a transport's start cannot be cut in slices) while this one polls them: the first
    that exits ends the wait at once, a RuntimeError with its exit code and the last lines of its stderr."""
    if not procs:
        try:
            return pool.start(n, timeout=timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; a worker joins with: {command}" if command else str(e)) from e
    tails = [_StderrTail(p) for p in procs]
    outcome: dict[str, object] = {}

    def start() -> None:
        try:
            outcome["infos"] = pool.start(n, timeout=timeout)
        except BaseException as e:  # handed over to the caller's thread
            outcome["error"] = e

    waiter = threading.Thread(target=start, name="tinyconv-hellos", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(WATCH_S)
        dead = next((i for i, p in enumerate(procs) if p.poll() is not None), None)
        if dead is not None and waiter.is_alive():
            raise RuntimeError(_death_notice(dead, procs[dead].returncode, tails[dead].last()))
    for t in tails:  # from now on what the workers say goes to our stderr (after a timeout, it may explain it)
        t.release()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["infos"]  # type: ignore[return-value]


def _death_notice(i: int, code: int, last: list[str]) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    said = ": " + " | ".join(last) if last else " without a word on stderr"
    return f"local worker {i} died before saying hello ({how}){said}"


class _StderrTail:
    """Reads a local worker's stderr (a pipe) in a thread: keeps its last lines for an error message,
    and holds what it writes until :meth:`release`, then echoes it, and all that follows, to ours."""

    def __init__(self, proc: subprocess.Popen, keep: int = 200) -> None:
        self._lines: deque[str] = deque(maxlen=keep)
        self._held: list[str] = []
        self._live = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), name="tinyconv-stderr", daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace")
                with self._lock:
                    self._lines.append(line.rstrip())
                    if self._live:
                        sys.stderr.write(line)
                    else:
                        self._held.append(line)

    def release(self) -> None:
        with self._lock:
            self._live = True
            held, self._held = self._held, []
            sys.stderr.writelines(held)

    def last(self, n: int = 5, wait: float = 2.0) -> list[str]:
        """The last ``n`` non-blank lines, once the stream has ended (waiting up to ``wait`` s for it)."""
        self._thread.join(wait)
        with self._lock:
            return [line.strip() for line in self._lines if line.strip()][-n:]


def spawn_local_workers(
    n: int,
    connect: str,
    backend: str = "numpy",
    extra_args: Sequence[str] = (),
    threads: int | None = None,
    stderr: int | None = None,
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Start ``n`` quiet worker processes on this machine that connect to ``connect``.

    They stay in this process's group, so a Ctrl-C reaches them too; and each exits on its own
    within its ``--peer-timeout`` and ``--retry-for`` (see :func:`worker_pool`) if this process dies. Stop them with
    :func:`stop_workers` after closing the transport. ``stderr``: theirs (default: this
    process's; ``subprocess.PIPE`` for a pipe that the caller must read). ``env``: added to this process's
    environment (the run's join secret: another user can read a command line, not an environment).
    """
    cmd = [sys.executable, "-m", "tinyconv.distributed.worker", "--connect", connect, "--backend", backend]
    cmd += ["--no-progress", *(["--threads", str(threads)] if threads else []), *extra_args]
    return [subprocess.Popen(cmd, stderr=stderr, env={**os.environ, **(env or {})}) for _ in range(n)]


def stop_workers(procs: Sequence[subprocess.Popen], timeout: float = 5.0) -> list[int]:
    """Wait up to ``timeout`` s for the workers to exit, then terminate, then kill. Returns exit codes."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]
