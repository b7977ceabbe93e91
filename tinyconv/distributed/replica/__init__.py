"""Data parallelism and the hybrid beside the paper's model parallelism: slices of the batch.

Read in this order: ``replica.py`` (what one participant computes on its slice, and why its
gradient is its share of the whole batch's), ``flat.py`` (the weights and gradients as one
vector each), ``batch.py`` (who gets how many images, on ``tinyconv/distributed/runtime.py``: shares,
calibration, the rebalancer, lost and joining workers), ``server.py`` (the parameter server: one
data-parallel step), ``conv_part.py`` and ``hybrid.py`` (Krizhevsky's hybrid: the conv part by
data, the classifier on the master). ``tinyconv.distribute(net, parallel="data")`` (or
"hybrid") starts them.
"""
