"""benchmarks/bench_opencl_profile.py: its per-op table at a tiny size (every op the network calls, on numpy
and OpenCL, a positive rate and a % of the roof for each op with a model) and its flop and byte models
against the shapes worked by hand. No figure is checked against a speed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_opencl_profile.py"
GEMM_OPS = {"conv2d_forward", "conv2d_backward", "linear_forward", "linear_backward"}
MEMORY_OPS = {"relu_lrn_forward", "relu_lrn_backward", "maxpool_forward", "maxpool_backward", "sgd_update"}
HEADERS = ["op", "work/step", "numpy ms/step", "numpy rate", "numpy % roof"]
HEADERS += ["opencl ms/step", "opencl rate", "opencl % roof", "opencl/numpy"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_opencl_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table(out: str, title: str) -> list[list[str]]:
    """The rows of the table printed under ``title``, its header row first, cells stripped."""
    rows = []
    for line in out[out.index(title) :].splitlines()[1:]:
        if not line.startswith(("|", "+")):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_first_table_rates_each_op_against_its_roof():
    from backends.opencl.device import NoOpenCLDevice, list_devices

    try:
        list_devices()
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TINYCONV_OPENCL_DEVICE"}
    command = [sys.executable, str(SCRIPT), "--arch", "4:8", "--batch-size", "2", "--repeats", "1"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "roofs, measured in this run" in out and "OpenBLAS SGEMM" in out and " GFLOP/s" in out
    header, *rows = table(out, "each op per step")
    assert header == HEADERS
    by_op = {row[0]: row for row in rows}
    assert GEMM_OPS | MEMORY_OPS | {"softmax_cross_entropy", "sum of ops"} <= set(by_op)
    for op in GEMM_OPS | MEMORY_OPS:
        unit = "GFLOP/s" if op in GEMM_OPS else "GB/s"
        for rate, roof in ((by_op[op][3], by_op[op][4]), (by_op[op][6], by_op[op][7])):
            assert rate.endswith(f" {unit}") and float(rate.split()[0]) > 0, (op, rate)
            assert roof.endswith("%") and float(roof[:-1]) >= 0, (op, roof)
    for op in MEMORY_OPS:  # each memory-bound op's copy roof, above the table
        assert f"\n    {op} " in out.split("each op per step")[0], op
    assert "the OpenCL kernels on the device" in out and "all kernels" in out


def test_the_models_count_each_gemm_and_each_array_once(bench):
    conv = {"op": "conv2d_forward", "x": (2, 3, 8, 8), "w": (4, 3, 5, 5), "out": (2, 4, 8, 8)}
    m, n, k = 4, 2 * 8 * 8, 3 * 5 * 5
    assert bench.FLOPS["conv2d_forward"](conv) == 2 * m * n * k
    assert bench.FLOPS["conv2d_backward"]({"cache": conv, "need_dx": True}) == 2 * 2 * m * n * k
    assert bench.FLOPS["conv2d_backward"]({"cache": conv, "need_dx": False}) == 2 * m * n * k
    linear = {"x": (2, 40), "w": (10, 40), "out": (2, 10)}
    assert bench.FLOPS["linear_forward"](linear) == 2 * 2 * 10 * 40
    assert bench.FLOPS["linear_backward"]({"cache": linear}) == 2 * 2 * 2 * 10 * 40
    pool = {"x": (2, 4, 8, 8), "out": (2, 4, 4, 4)}
    assert bench.BYTES["maxpool_forward"](pool) == 4 * (512 + 128)
    assert bench.BYTES["maxpool_backward"]({"dy": (2, 4, 4, 4), "cache": pool}) == 4 * (128 + 2 * 512)
    assert bench.BYTES["sgd_update"]({"param": (4, 3, 5, 5)}) == 4 * 5 * 300
    assert bench.work("asarray", [{}]) is None
    assert bench.si(2.87e6, "FLOP") == "2.87 MFLOP" and bench.si(160, "B") == "160 B"
