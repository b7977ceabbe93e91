"""Starting the workers of a data-parallel or hybrid run: :func:`replicate`, the counterpart of ``tinyconv.distribute``.

    net = tc.paper_net("50:500", norm="lrn")
    with replicate(net, transport="zmq", workers=1, batch_size=64) as replicas:
        loss, logits = replicas.train_batch(net, x, y)   # net's grads: the whole batch's
        opt.step()

``parallel="hybrid"`` gives the hybrid instead (``hybrid.py``: the conv part by data, the
classifier on the master), with the same calls.

The workers are the same as for model parallelism (``tinyconv worker``, or threads): the
task protocol has the replica tasks beside the sharded layers' ones.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any

from tinyconv.model import Network
from tinyconv.dist.pool import message_cap, worker_pool
from tinyconv.dist.replica import flat
from tinyconv.dist.replica.batch import BatchSplit
from tinyconv.dist.replica.conv_part import feature_shape
from tinyconv.dist.replica.hybrid import Hybrid
from tinyconv.dist.replica.server import Replicas, logits_width

KINDS: dict[str, type[BatchSplit]] = {"data": Replicas, "hybrid": Hybrid}


def replica_message_bytes(net: Network, batch: int, image_size: int = 32) -> int:
    """The most array bytes one replica or hybrid task or result can carry at ``batch`` images: the
    weights (or gradients) and the statistics, all of the batch's images, labels (as int64), logits
    and features (the hybrid's, or their gradient)."""
    p, b = sum(flat.sizes(net)), sum(flat.sizes(net, "buffers"))
    in_channels = next(layer for layer in net.layers if "w" in layer.params).params["w"].shape[1]
    features = math.prod(feature_shape(net, image_size))
    per_image = 4 * in_channels * image_size * image_size + 8 + 4 * logits_width(net) + 4 * features
    return 4 * (p + b) + batch * per_image


def replicate(
    net: Network,
    transport: str = "inproc",
    workers: int = 2,
    *,
    worker_backend: str | None = None,
    batch_size: int = 64,
    largest_batch: int | None = None,
    image_size: int = 32,
    calibrate: bool = True,
    pool_options: dict[str, Any] | None = None,
    parallel: str = "data",
    **options: Any,
) -> BatchSplit:
    """Start ``workers`` workers over ``transport`` and return the :class:`Replicas` of ``net`` on them
    (``parallel="hybrid"``: the :class:`Hybrid`), timed on ``batch_size`` images and split by eq. 1
    (``calibrate``), else equally.

    ``pool_options`` go to :func:`~tinyconv.dist.pool.worker_pool` (worker_device, bind, external,
    worker_threads, start_timeout, peer_timeout, key, authorized_keys, insecure, announce);
    ``options`` to :class:`Replicas` (master_share, rebalance, rebalancer, recv_timeout). A message
    may carry what a replica step at ``largest_batch`` images needs, or a sharded layer's."""
    if parallel not in KINDS:
        raise ValueError(f"parallel must be one of {', '.join(KINDS)}, got {parallel!r}")
    largest = max(batch_size, largest_batch or 0)
    cap = 2 * max(replica_message_bytes(net, largest, image_size), message_cap(net, largest, image_size))
    stack = ExitStack()
    try:
        pool, infos = stack.enter_context(worker_pool(
            transport, workers, worker_backend=worker_backend or net.backend.name, max_message_bytes=cap,
            **(pool_options or {}),
        ))  # fmt: skip
        replicas = KINDS[parallel](pool, infos, net.backend, image_size=image_size, **options)
        replicas.on_close = stack.close
        if calibrate:
            replicas.calibrate(net, batch_size)
    except BaseException:
        stack.close()
        raise
    return replicas
