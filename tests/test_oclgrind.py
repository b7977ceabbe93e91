"""The OpenCL kernels on a simulated GPU that checks every memory access: Oclgrind.

Oclgrind (Debian's ``oclgrind``; ``make setup`` installs it where it can run apt-get) is an
OpenCL device simulator: run under ``oclgrind --data-races``, a program sees one GPU, "Oclgrind
Simulator", with 32 KiB of local memory and work-groups of up to 1024, and every kernel it runs
is checked for reads and writes outside their buffers (or outside local memory) and for data
races between work-items. That device is a GPU, so the backend picks the GPU variants there
(the local-memory tiled GEMMs, work-groups of 64, the per-element kernels): what no CPU runs,
checked without a GPU; the rows kernels CPUs run instead are launched by the tests themselves.

Oclgrind reports into its log and still exits 0, so the tests read the log. Its check of
uninitialised values (``--uninitialized``) is not used: in Oclgrind 21.10 it stops at LLVM's
``freeze`` instruction, and it reports a vector store that LLVM builds from poison lanes and
then fills lane by lane, corrupting the results it checks.

Each test is a subprocess under ``oclgrind`` (the simulator replaces the OpenCL library of
the whole process): the OpenCL test file, in two halves side by side (the simulator runs on one
core), then the conformance suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

OCLGRIND = shutil.which("oclgrind")
ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    OCLGRIND is None, reason="oclgrind is not installed (Debian's oclgrind; make setup installs it as root)"
)


def under_oclgrind(args: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python args`` on Oclgrind's simulated GPU, its reports in ``log``."""
    env = {**os.environ, "TINYCONV_OPENCL_AUTOTUNE": "0"}  # the variants are each run by the tests
    env.pop("TINYCONV_OPENCL_DEVICE", None)
    command = [OCLGRIND, "--data-races", "--max-errors", "20", "--log", str(log), sys.executable, *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def reports(log: Path) -> list[str]:
    """Oclgrind's error lines (each report starts at column 0; its details are indented)."""
    text = log.read_text() if log.exists() else ""
    return [line for line in text.splitlines() if line.strip() and not line[0].isspace()]


def test_oclgrind_catches_an_out_of_bounds_write_and_a_race(tmp_path):
    # the check itself: without this, an Oclgrind that checked nothing would pass the tests below
    kernels = """
    __kernel void past_the_end(__global float* a) { a[get_global_id(0) + 1] = 1.0f; }
    __kernel void race(__global float* a) { a[0] = (float)get_global_id(0); }
    """
    script = tmp_path / "broken.py"
    script.write_text(
        "import pyopencl as cl\n"
        "ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]]); q = cl.CommandQueue(ctx)\n"
        f"prg = cl.Program(ctx, {kernels!r}).build()\n"
        "buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 16 * 4)\n"
        "prg.past_the_end(q, (16,), (16,), buf); prg.race(q, (16,), (16,), buf); q.finish()\n"
        "print(ctx.devices[0].name)\n"
    )
    log = tmp_path / "oclgrind.log"
    done = under_oclgrind([str(script)], log, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Oclgrind Simulator"
    found = "\n".join(reports(log))
    assert "Invalid write of size 4" in found and "data race" in found, found


def test_the_opencl_tests_pass_on_the_simulated_gpu_with_no_report(tmp_path):
    # every op, every GEMM variant the device allows (tiled, with local memory), split-K, strided views,
    # and the CPU-only rows kernels of ops.cl and layout.cl, which its tests launch by name beside the
    # per-element ones (test_*_rows_kernels_*, the max pool and batch norm tests with rows=True; max pool's
    # planes and lanes kernels and the LRN backward's channel walk, which are built per plane size and block, too;
    # the panels' 8-pixel lanes kernels, test_im2col_and_im2row_lanes_kernels_*); and the wire words'
    # kernels of wire.cl, both variants (tests/test_wire_convert.py)
    log = tmp_path / "oclgrind.log"
    device = "import backends.opencl.device as d; print(d.describe_device(d.select_device(None)))"
    probe = under_oclgrind(["-c", device], log, timeout=120)
    assert "'Oclgrind Simulator'" in probe.stdout and "'kind': 'gpu'" in probe.stdout, probe.stdout + probe.stderr
    # all but the training runs of a small network, the GEMM's two largest shapes, the largest convolution and
    # the autotuner's cache: the same kernels again, minutes in the simulator (its (33, 70, 51) takes every GEMM
    # variant over several tiles, split K and two-level k; the smaller convolutions, every im2col and bias path)
    skipped = "not small_paper_net and not 50-75-300 and not 1-1-700 and not 3-7-13-11-17 and not autotune_saves"
    tests = ["tests/test_opencl.py", "tests/test_wire_convert.py", "-k", skipped]
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    assert len(ids) > 200 and any("33-70-51" in i for i in ids), listed.stdout[-3000:]
    halves = [(ids[i::2], tmp_path / f"oclgrind{i}.log") for i in range(2)]

    def run(half: tuple[list[str], Path]) -> subprocess.CompletedProcess:
        return under_oclgrind(["-m", "pytest", "-q", "-p", "no:cacheprovider", *half[0]], half[1], timeout=900)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(run, halves))
    for done, (_, half_log) in zip(runs, halves, strict=True):
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert reports(half_log) == [], half_log.read_text()[:5000]


def test_the_conformance_suite_passes_on_the_simulated_gpu_with_no_report(tmp_path):
    log = tmp_path / "oclgrind.log"
    done = under_oclgrind(["-m", "backends.conformance.runner", "--backend", "opencl"], log, timeout=300)
    assert done.returncode == 0 and " 0 failed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert reports(log) == [], log.read_text()[:5000]
