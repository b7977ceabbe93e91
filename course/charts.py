"""What every lesson shares: how big it runs, and where its charts go.

``COURSE_QUICK=1`` runs each lesson on tiny shapes (CI, or a first run-through). Charts go to
``$COURSE_FIGURES``, else ``course/_build/figures`` when run from the repository's root (it is
gitignored), else ``./figures``. ``course/build.py`` hands this file out beside the lessons.
"""

from __future__ import annotations

import os
from pathlib import Path

QUICK = os.environ.get("COURSE_QUICK") == "1"
FIGURES = Path(os.environ.get("COURSE_FIGURES") or ("course/_build/figures" if Path("course/build.py").is_file()
                                                    else "figures"))  # fmt: skip


def show(svg: str, name: str) -> Path:
    """Write an SVG chart to FIGURES and, in a notebook, draw it."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / name
    path.write_text(svg)
    try:
        from IPython import get_ipython
        from IPython.display import SVG, display

        if get_ipython() is not None:
            display(SVG(svg))
    except ImportError:
        pass
    print(f"chart: {path}")
    return path
