"""Distribution: the runtime that splits a network's work across the master and its workers.

The framework (``tinyconv/``: layers, model, optimiser, trainer, data) never imports this
package; :func:`tinyconv.distribute` plugs it in. Read in this order:

* ``shard/`` -- the paper's split, readable on its own: ``balance.py`` (eq. 1), ``plan.py`` (who
  computes which kernels), ``block.py`` (a convolution and its tail), ``by_kernels.py`` (the
  split by kernels), then ``by_channels.py``, ``layer.py`` and ``cluster.py``;
* ``replica/`` -- data parallelism and the hybrid: slices of the batch;
* the runtime every parallelism uses: ``runtime.py`` (participants and where they run, loss, joins,
  deadlines, calibration by eq. 1), ``calibrate.py``, ``cost.py``, ``rebalance.py`` and
  ``link_speed.py`` (timing and re-apportioning), ``accounting.py`` (the step's comm / conv /
  comp), ``rpc.py`` and ``protocol.py`` (the tasks on the wire), ``wire_codec.py`` (optional
  narrower words, a codec at the edges: ``wire_precision.py`` the formats, ``adaptive_precision.py``
  which array goes in which), ``conv_shapes.py`` and ``heap.py``;
* ``worker/`` -- what a worker runs: the task handlers that answer the master's split;
* ``pool.py`` -- starting and stopping workers, and :func:`~tinyconv.distributed.pool.distribute`.
"""
