"""The parameter server: the master splits each batch among whole replicas and sums their gradients.

    replicas = Replicas(transport, workers, backend)
    replicas.calibrate(net, batch_size=64)            # everyone times a forward + backward; eq. 1
    loss, logits = replicas.train_batch(net, x, y)    # one data-parallel step: net's grads filled
    opt.step()                                        # the master applies the optimiser itself
    replicas.last_step                                # comm/conv split, bytes, image shares

One step: worker i gets its slice x[s_i:e_i], y[s_i:e_i] and the weights, whole (``replica_step``),
the master computes its own slice meanwhile, and sums the slices' gradients (``replica.py``) in
participant order. docs/how-it-works.md ("Model, data or hybrid parallelism") says why the weights go
whole, what a step moves, and what batch norm does per slice.
"""

from __future__ import annotations

import math

import numpy as np

from backends.base import Array
from tinyconv.distributed.accounting import OpStats
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.batch import BatchSplit, Slices
from tinyconv.distributed.replica.conv_part import feature_shape
from tinyconv.distributed.replica.replica import slice_gradients, time_replica
from tinyconv.model import Network
from transports.base import Message


class Replicas(BatchSplit):
    """The master and its workers, each with a whole replica (options: :class:`BatchSplit`'s)."""

    parallel = "data"
    calibrate_task = "replica_calibrate"  # a forward + backward of the whole replica
    time_slice = staticmethod(time_replica)

    def _start(self, net: Network) -> tuple[np.ndarray, np.ndarray]:
        return flat.pack(net), flat.pack(net, "buffers")

    def _step(
        self, net: Network, x: np.ndarray, y: np.ndarray, start: tuple[np.ndarray, np.ndarray], smoothing: float
    ) -> tuple[float, Array]:
        params, buffers = start
        cut = Slices.of(self.placement, self.shares(len(x)))
        op = self._op("data-parallel step", cut.batch)
        extra = {"buffers": buffers} if buffers.size else {}
        smoothed = {"smoothing": smoothing} if smoothing else {}
        tasks = []
        for k, s, e in cut.workers():  # a header of its own each: sending adds the task's number to it
            header, arrays = {"net": self._spec, "batch": cut.batch, **smoothed}, {"x": x[s:e], "y": y[s:e]}
            probe = self.spot.probe_for(k, net) if self.spot is not None else {}
            tasks.append(op.send(k, Message("replica_step", header, arrays | {"params": params, **extra, **probe})))
        grads, logits, stats = {}, {}, {}
        if cut.mine is not None:
            s, e = cut.mine
            with op.local():
                flat.unpack(net, buffers, "buffers")  # the step's start, again if it is a re-run
                logits[None] = slice_gradients(net, x[s:e], y[s:e], cut.batch, smoothing)
                grads[None], stats[None] = flat.pack(net, "grads"), flat.pack(net, "buffers")
        for k, reply in op.gather(tasks).items():
            grads[k] = op.array(k, reply, "grads", params.shape)
            logits[k] = op.array(k, reply, "logits", (cut.share[k], logits_width(net)))
            stats[k] = op.array(k, reply, "stats", buffers.shape) if buffers.size else buffers
        cut.sum_into(net, grads, stats, buffers)
        self._finish([("step", OpStats.from_op(op, self.placement))], cut.counts)
        logits_be = net.backend.asarray(np.concatenate([logits[k] for k in cut.order]))
        loss, _ = net.training_loss(smoothing)(logits_be, y)
        return loss, logits_be


def replica_message_bytes(net: Network, batch: int, image_size: int = 32) -> int:
    """The most array bytes one replica or hybrid task or result can carry at ``batch`` images: the
    weights (or gradients) and the statistics, all of the batch's images, labels (as int64), logits
    and features (the hybrid's, or their gradient)."""
    p, b = sum(flat.sizes(net)), sum(flat.sizes(net, "buffers"))
    in_channels = next(layer for layer in net.layers if "w" in layer.params).params["w"].shape[1]
    features = math.prod(feature_shape(net, image_size))
    per_image = 4 * in_channels * image_size * image_size + 8 + 4 * logits_width(net) + 4 * features
    return 4 * (p + b) + batch * per_image


def logits_width(net: Network) -> int:
    """The number of classes: the width of the network's last parameter, the classifier's bias."""
    return int(net.layers[-1].params["b"].shape[0])
