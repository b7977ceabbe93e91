"""Data parallelism and the hybrid beside the paper's model parallelism: slices of the batch.

``replica.py`` and ``flat.py`` (one participant's slice, the weights as one vector), ``batch.py`` (who
gets how many images), ``server.py`` (data parallelism) and ``conv_part.py`` with ``hybrid.py`` (the hybrid).
"""
