"""Data parallelism beside the paper's model parallelism: whole replicas, slices of the batch.

Read in this order: ``replica.py`` (what one participant computes on its slice, and why its
gradient is its share of the whole batch's), ``flat.py`` (the weights and gradients as one
vector each), ``server.py`` (the parameter server: shares, one step, lost and joining
workers), ``start.py`` (starting the workers, like ``tinyconv.distribute``).
"""
