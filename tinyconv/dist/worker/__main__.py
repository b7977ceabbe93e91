"""``python -m tinyconv.dist.worker``: the same as ``tinyconv worker``."""

import sys

from tinyconv.dist.worker.main import main

sys.exit(main())
