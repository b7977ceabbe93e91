"""Distribution: the runtime that splits a network's work across the master and its workers.

The framework (``tinyconv/``) never imports this package; :func:`tinyconv.distribute` plugs it in.
``shard/`` is the paper's split (start with ``by_kernels.py``), ``replica/`` data parallelism and the
hybrid, ``runtime.py`` what every parallelism shares, ``worker/`` what a worker runs, ``pool.py``
starting and stopping workers; docs/how-it-works.md reads them in order.
"""
