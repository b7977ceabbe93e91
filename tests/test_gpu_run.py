"""benchmarks/gpu_run.py: its dry run on whatever OpenCL device is here (PoCL in CI) writes every part's
figures or the reason it has none; the ICD file it writes for a vendor library no ICD file names; its
errors for a machine with no GPU and for missing packages. No figure is checked against a speed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_run.py"
spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
gpu_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_run)

PARTS = {"conformance", "gemm", "step", "split"}


def opencl_devices() -> list[dict]:
    """This machine's OpenCL devices, or a skip saying there are none."""
    from backends.opencl.device import NoOpenCLDevice, list_devices

    try:
        return list_devices()
    except NoOpenCLDevice as e:
        pytest.skip(f"no OpenCL device: {e}")


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TINYCONV_OPENCL_DEVICE"}
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_dry_run_writes_each_parts_figures_or_why_it_has_none(tmp_path):
    opencl_devices()
    out = tmp_path / "dry-run.json"
    done = run_script("--dry-run", "--out", str(out), timeout=600)  # bounds the wait: the run takes seconds
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| part " in done.stdout and "GPU run (dry run)" in done.stdout
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["installed"] == [] and set(result["parts"]) == PARTS
    assert result["device"]["spec"] and result["driver"]["icd_dirs"] is not None
    for name, part in result["parts"].items():
        assert part["status"] in ("ran", "skipped"), (name, part)
        assert part["status"] == "ran" or part["reason"], (name, part)
    conformance, gemm, step, split = (result["parts"][p] for p in ("conformance", "gemm", "step", "split"))
    assert conformance["passed"] > 0 and conformance["failed"] == 0
    assert [r["arch"] for r in gemm["rows"]] == ["50:500"] and gemm["rows"][0]["opencl_fwd_gflops"] > 0
    assert (gemm["torch"] is None) != (gemm["torch_skipped"] is None)  # torch's column, or why there is none
    if gemm["torch"]:
        assert gemm["rows"][0]["torch_mm_fwd_gflops"] > 0 and gemm["rows"][0]["torch_conv_bwd_gflops"] > 0
    assert step["opencl_step_s"] > 0 and step["numpy_step_s"] > 0
    assert split["participants"][0] == "master" and split["worker"]["backend"] == "opencl"
    assert "conv2=" in split["shares"] and split["steps"] >= 1 and split["speedup"] > 0


def test_an_icd_file_is_written_for_a_vendor_library_no_icd_file_names(tmp_path, monkeypatch):
    libs, vendors, out = tmp_path / "lib", tmp_path / "vendors", tmp_path / "out"
    for d in (libs, vendors, out):
        d.mkdir()
    (libs / "libnvidia-opencl.so.1").write_bytes(b"")
    (vendors / "pocl.icd").write_text("libpocl.so.2\n")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(libs))
    monkeypatch.setenv("OCL_ICD_VENDORS", str(vendors))
    driver = gpu_run.find_driver(out)
    assert driver["vendor_libraries"]["nvidia"] == str(libs / "libnvidia-opencl.so.1")
    assert (out / "nvidia-tinyconv.icd").read_text().strip() == str(libs / "libnvidia-opencl.so.1")
    assert (out / "pocl.icd").read_text() == "libpocl.so.2\n"  # the runtimes installed stay visible
    assert os.environ["OCL_ICD_VENDORS"] == driver["OCL_ICD_VENDORS"] == str(out)

    (vendors / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")  # the driver's own ICD file: nothing written
    monkeypatch.setenv("OCL_ICD_VENDORS", str(vendors))
    again = tmp_path / "again"
    again.mkdir()
    driver = gpu_run.find_driver(again)
    assert driver["icd_written"] == {} and list(again.iterdir()) == [] and os.environ["OCL_ICD_VENDORS"] == str(vendors)


def test_without_a_gpu_it_says_what_it_looked_for_and_what_to_install(tmp_path):
    if any(d["kind"] == "gpu" for d in opencl_devices()):
        pytest.skip("this machine has an OpenCL GPU")
    done = run_script("--out", str(tmp_path / "run.json"), timeout=120)
    assert done.returncode != 0 and not (tmp_path / "run.json").exists()
    for needle in ("no OpenCL GPU found", "Looked for ICD files", "libnvidia-opencl.so.1", "libamdocl64.so", "ROCm"):
        assert needle in done.stderr, done.stderr


def test_missing_packages_name_the_wheels_to_bring(monkeypatch):
    monkeypatch.setattr(gpu_run, "NEEDED", {"tinyconv_no_such_module": "no-such-dist", "numpy": "numpy"})
    assert gpu_run.missing_packages() == ["no-such-dist"]
    with pytest.raises(SystemExit, match="missing no-such-dist. Give --wheels DIR"):
        gpu_run.install_wheels(None)
    monkeypatch.setattr(gpu_run, "NEEDED", {"numpy": "numpy"})
    assert gpu_run.install_wheels(None) == []  # nothing missing: pip is not run
