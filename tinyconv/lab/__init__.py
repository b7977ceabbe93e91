"""The paper's lab: what tinyconv measures and predicts about itself, never needed to train.

* ``eq2.py``       -- the bytes of one step: the paper's eq. 2 and tinyconv's (``tinyconv comm``);
* ``paper.py``     -- the paper's measured speedups, to set beside ours;
* ``experiment/``  -- the speedup grid (``tinyconv experiment grid``);
* ``simulate/``    -- a step's time on 1 to 128 participants, predicted (``tinyconv simulate``);
* ``plot/``        -- charts from metrics files and tables (``tinyconv plot``).

The runtime (``tinyconv/distributed``) and the framework never import this package.
"""
