"""The speedups Marques, Falcão & Alexandre (2017) report, as far as this project knows them.

One place for them, so that the experiment grid's summary, the plots and docs/results.md quote the
same numbers. What is known here -- and only this:

* 2 CPUs (the master + one worker): **1.69x** on ``300:1000`` and **1.98x** on ``500:1500``
  (Table 4). The batch size of these two values is not recorded here: the paper's tables
  run batches from 64 to 1024, and which batch these two came from is not known to this
  project, so they carry ``batch=None`` ("some batch of the paper's range").
* The best speedups overall, both on ``500:1500``: **3.28x** with 4 CPUs and **2.45x** with
  3 GPUs (again, batch not recorded here).

What is *not* known here: the 2-CPU values of ``50:500`` and ``150:800``, any 3-CPU value, any
value per batch size, and the remaining cells of Tables 4 and 5. Do not fill them in from
memory; add them with the table they come from if someone reads them off the paper.

    from tinyconv.lab.paper import PAPER_SPEEDUPS, paper_speedup
    paper_speedup("300:1000", 2)            # 1.69
    paper_speedup("50:500", 2)              # None: not known
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperSpeedup:
    """One speedup the paper reports: ``arch`` on ``participants`` devices of ``device`` kind."""

    arch: str  # "C1:C2", kernels of the two convolutions
    participants: int  # devices in all, the master included
    device: str  # "cpu" or "gpu"
    speedup: float
    batch: int | None  # None: the batch is not recorded here
    source: str  # where in the paper


PAPER_SPEEDUPS: tuple[PaperSpeedup, ...] = (
    PaperSpeedup("300:1000", 2, "cpu", 1.69, None, "Table 4, 2 CPUs"),
    PaperSpeedup("500:1500", 2, "cpu", 1.98, None, "Table 4, 2 CPUs"),
    PaperSpeedup("500:1500", 4, "cpu", 3.28, None, "best with 4 CPUs"),
    PaperSpeedup("500:1500", 3, "gpu", 2.45, None, "best with 3 GPUs"),
)


def paper_speedup(arch: str, participants: int, device: str = "cpu") -> float | None:
    """The paper's speedup of ``arch`` on ``participants`` devices of kind ``device``; None if not known here."""
    for p in PAPER_SPEEDUPS:
        if (p.arch, p.participants, p.device) == (arch, participants, device):
            return p.speedup
    return None
