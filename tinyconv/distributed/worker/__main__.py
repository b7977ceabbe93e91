"""``python -m tinyconv.distributed.worker``: the same as ``tinyconv worker``."""

import sys

from tinyconv.distributed.worker.main import main

sys.exit(main())
