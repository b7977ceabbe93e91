"""``python -m tinyconv.worker``: the same as ``tinyconv worker``."""

import sys

from tinyconv.worker.main import main

sys.exit(main())
