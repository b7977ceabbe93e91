"""distribute(): share a network's convolutions among workers in one call.

    import tinyconv as tc
    net = tc.paper_net("50:500")
    with tc.distribute(net, transport="zmq", workers=2) as cluster:   # two local worker processes
        loss = net.train_step(x, y)                                  # the convolutions run in shards
        print(cluster.last_step["shares"])

It starts the workers (``tinyconv/worker/pool.py``), builds the :class:`Cluster`, times
every participant and splits each layer by the paper's eq. 1 (``calibrate.py``), and
puts a :class:`~tinyconv.shard.layer.ShardedBlock` in the network for each convolution.
Closing the cluster puts the network's own layers back and stops the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from tinyconv.model import Network
from tinyconv.shard.cluster import Cluster
from tinyconv.worker.pool import worker_pool


def distribute(
    net: Network,
    transport: str = "inproc",
    workers: int = 2,
    *,
    worker_backend: str | None = None,
    worker_device: str | None = None,
    bind: str | None = None,
    external: bool = False,
    worker_threads: int | None = None,
    start_timeout: float = 60.0,
    batch_size: int = 64,
    image_size: int = 32,
    calibrate: bool = True,
    announce: Callable[[str], None] = print,
    **options: Any,
) -> Cluster:
    """Start ``workers`` workers over ``transport`` ("inproc" threads, or "zmq" processes -- with
    ``external``, on other machines) and shard ``net``'s convolutions across them and the master.

    ``worker_backend`` defaults to the master's. ``calibrate``: time everyone on ``batch_size``
    images of ``image_size`` pixels and split by eq. 1; otherwise start from an equal split.
    ``options`` go to :class:`Cluster` (master_share, split, fuse, rebalance, rebalancer,
    recv_timeout). Returns the cluster; ``close()`` it, or use it in a ``with`` block.
    """
    stack = ExitStack()
    try:
        pool, infos = stack.enter_context(
            worker_pool(
                transport,
                workers,
                worker_backend=worker_backend or net.backend.name,
                worker_device=worker_device,
                bind=bind,
                external=external,
                worker_threads=worker_threads,
                start_timeout=start_timeout,
                announce=announce,
            )
        )
        cluster = Cluster(pool, infos, net.backend, **options)
        cluster.on_close = stack.close
        if calibrate:
            cluster.calibrate(net, batch_size, image_size)
        else:
            cluster.attach(net)
    except BaseException:
        stack.close()
        raise
    return cluster
