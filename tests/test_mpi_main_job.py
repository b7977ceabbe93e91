"""The main job under ``mpiexec``: rank 0 trains, the other ranks serve it, in every --parallel mode.

Skipped, with the reason, where mpi4py or ``mpiexec`` is missing (``make setup`` installs both).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "examples" / "cifar10_dist.py"
JOB_TIMEOUT = 120.0  # a passing job takes a few seconds; a hung one is killed, with every rank


def mpiexec() -> str:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]' or make setup)")
    found = Path(sys.executable).parent / "mpiexec"
    if not found.exists():
        pytest.skip("no mpiexec beside this python (pip install -e '.[mpi]' installs MPICH's)")
    return str(found)


def run_main(ranks: int, *options: str) -> subprocess.CompletedProcess:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(MAIN), "--transport", "mpi", *options]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec did not end within {JOB_TIMEOUT:g} s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


SMALL = ("--dataset", "synthetic", "--steps", "3", "--arch", "4:8", "--no-progress")


@pytest.mark.parametrize("parallel", ["model", "data", "hybrid"])
def test_the_main_job_trains_under_mpiexec_with_the_other_ranks_as_workers(parallel):
    done = run_main(3, *SMALL, "--parallel", parallel)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "test accuracy" in done.stdout and "participants" in done.stdout
    assert "master, worker0, worker1" in done.stdout  # both other ranks took part
    assert done.stderr.count("shutdown: train over") == 2  # and were told the training is over


def test_workers_that_do_not_match_the_ranks_are_refused_with_the_mpiexec_to_use():
    done = run_main(2, *SMALL, "--workers", "3")
    assert "--workers 3 under mpi needs mpiexec -n 4, not -n 2" in done.stdout + done.stderr
    assert "test accuracy" not in done.stdout
