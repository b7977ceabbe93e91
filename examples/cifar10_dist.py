#!/usr/bin/env python3
"""The main job: train the paper's CNN on CIFAR-10, its convolutions split by kernels across workers.

    python examples/cifar10_dist.py --transport zmq --backend opencl     # the main job: workers over ZeroMQ
    python examples/cifar10_dist.py --dataset synthetic --steps 50       # a smoke run: a minute or two
    python examples/cifar10_dist.py --help                               # every option

This is `tinyconv train`, the command `pip install` puts on the path; both run tinyconv/commands/train.py,
whose ``start`` reads top to bottom as a run goes:

1. Every option is checked before any work (tinyconv/commands/train_checks.py): a bad one is one line on
   stderr and exit 2, before the data loads, a worker starts or a socket opens.
2. The master's backend and CIFAR-10 (downloaded once, 163 MB), then the plan: the preset, the network, the
   epochs and steps, and the accuracy and time to expect, as measured.
3. The network: conv 5x5 -> norm -> pool -> conv 5x5 -> norm -> pool -> fully connected -> softmax loss.
4. The workers (tinyconv.distribute): local processes here, or ones on other machines that connect.
5. The split: every participant is timed on each convolution's shape, and gets a share of its kernels in
   proportion to its speed (the paper's eq. 1, tinyconv/distributed/shard/by_kernels.py).
6. Training (tinyconv/trainer.py): each step the master sends the batch and every worker its kernels; the
   workers send back their feature maps, and later their gradients; the master trains every other layer.
   Lost, joined and lagging workers, and the new shares, are printed as they happen.
7. The summary table, and the last line: the test accuracy reached and the wall time.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a checkout without installing

from tinyconv.commands.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
