"""The hybrid: the convolutional part by data, the classifier on the master (Krizhevsky's "one weird trick").

    hybrid = Hybrid(transport, workers, backend)
    hybrid.calibrate(net, batch_size=64)            # everyone times the conv part's forward + backward
    loss, logits = hybrid.train_batch(net, x, y)    # one hybrid step: net's grads filled
    opt.step()                                      # the master applies the optimiser itself

A step is two rounds with the classifier between them, on the master: ``hybrid_forward`` (images and
the conv part's weights out, features (n_i, F) back) and ``hybrid_backward`` (rows of dL/dfeatures
out, conv-part gradients back). ``conv_part.py`` has the math; docs/how-it-works.md ("Model, data or
hybrid parallelism") the step and its bytes. Shares, calibration, lost and joining workers: ``batch.py``.
"""

from __future__ import annotations

import math

import numpy as np

from backends.base import Array
from tinyconv.distributed.accounting import OpStats
from tinyconv.distributed.replica import flat
from tinyconv.distributed.replica.batch import BatchSplit, Slices
from tinyconv.distributed.replica.conv_part import (
    backward_features,
    classifier,
    conv_part,
    feature_shape,
    forward_features,
    time_conv_part,
)
from tinyconv.model import Network
from transports.base import Message


class Hybrid(BatchSplit):
    """The master and its workers: the conv part of each batch by images, the classifier on the master
    (options: :class:`BatchSplit`'s)."""

    parallel = "hybrid"
    calibrate_task = "hybrid_calibrate"  # a forward + backward of the conv part
    time_slice = staticmethod(time_conv_part)

    def _start(self, net: Network) -> tuple[np.ndarray, np.ndarray]:
        conv = conv_part(net)
        return flat.pack(conv), flat.pack(conv, "buffers")

    def _step(
        self, net: Network, x: np.ndarray, y: np.ndarray, start: tuple[np.ndarray, np.ndarray], smoothing: float
    ) -> tuple[float, Array]:
        params, buffers = start
        conv, fc = conv_part(net), classifier(net)
        shape = feature_shape(net, self.image_size)
        f = math.prod(shape)
        cut = Slices.of(self.placement, self.shares(len(x)))

        # 1. forward: every participant's features
        fwd = self._op("hybrid forward, step", cut.batch)
        extra = {"buffers": buffers} if buffers.size else {}
        tasks = []
        for k, s, e in cut.workers():
            header, arrays = {"net": self._spec, "batch": cut.batch}, {"x": x[s:e], "params": params, **extra}
            arrays |= self.spot.probe_for(k, conv) if self.spot is not None else {}
            tasks.append(fwd.send(k, Message("hybrid_forward", header, arrays)))
        features, stats = {}, {}
        if cut.mine is not None:
            with fwd.local():
                flat.unpack(conv, buffers, "buffers")  # the step's start, again if it is a re-run
                features[None] = forward_features(conv, x[cut.mine[0] : cut.mine[1]])
                stats[None] = flat.pack(conv, "buffers")
        for k, reply in fwd.gather(tasks).items():
            features[k] = fwd.array(k, reply, "features", (cut.share[k], f))
            stats[k] = fwd.array(k, reply, "stats", buffers.shape) if buffers.size else buffers
        forward = OpStats.from_op(fwd, self.placement)  # its wall time ends here: the classifier is the master's comp

        # 2. the classifier and the loss over the whole batch, on the master alone
        loss, logits, dfeatures = classify(net, fc, np.concatenate([features[k] for k in cut.order]), y, smoothing)

        # 3. backward: every participant's conv gradient
        bwd = self._op("hybrid backward, step", cut.batch)
        tasks = [
            bwd.send(k, Message("hybrid_backward", {}, {"dfeatures": dfeatures[s:e]})) for k, s, e in cut.workers()
        ]
        grads = {}
        if cut.mine is not None:
            with bwd.local():
                backward_features(conv, dfeatures[cut.mine[0] : cut.mine[1]], shape)
                grads[None] = flat.pack(conv, "grads")
        for k, reply in bwd.gather(tasks).items():
            grads[k] = bwd.array(k, reply, "grads", params.shape)
        backward = OpStats.from_op(bwd, self.placement)

        # 4. the conv gradients summed in participant order; the statistics weighted by images
        cut.sum_into(conv, grads, stats, buffers)
        self._finish([("forward", forward), ("backward", backward)], cut.counts)
        return loss, logits


def classify(
    net: Network, fc: Network, features: np.ndarray, y: np.ndarray, smoothing: float = 0.0
) -> tuple[float, Array, np.ndarray]:
    """The classifier forward and backward on the whole batch's ``features`` (N, F), on the master:
    -> (the loss, label-smoothed by ``smoothing``; the logits (N, classes); dL/dfeatures (N, F) float32).
    The classifier's own grads are complete afterwards; the loss is the mean over all N images, so no
    slice rescales its gradient."""
    be = net.backend
    logits = fc.forward(be.asarray(features), training=True)
    loss, d = net.training_loss(smoothing)(logits, y)  # dL/dlogits = (softmax - q) / N
    for layer in reversed(fc.layers):
        d = layer.backward(d)
    return loss, logits, np.ascontiguousarray(be.to_numpy(d), dtype=np.float32).reshape(features.shape)
