"""The main job, examples/cifar10_dist.py, end to end as a user runs it (small synthetic runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tinyconv.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cifar10_dist.py"


def run_example(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


SMOKE = ("--dataset", "synthetic", "--arch", "4:8", "--batch-size", "32")


def test_help_describes_every_option():
    out = run_example("--help")
    assert out.returncode == 0
    for flag in ("--transport", "--workers", "--backend", "--arch", "--steps", "--split", "--metrics-out", "--resume"):
        assert flag in out.stdout


def test_master_alone_runs_and_writes_metrics(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = run_example(*SMOKE, "--steps", "5", "--workers", "0", "--metrics-out", str(metrics))
    assert out.returncode == 0, out.stderr
    assert "Summary" in out.stdout and "test_acc" in out.stdout
    events = read_metrics(metrics)
    assert events[0]["event"] == "run" and events[0]["transport"] is None and events[0]["workers"] == []
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert [e["event"] for e in events[-2:]] == ["epoch", "summary"]


@pytest.mark.parametrize("split", ["auto", "kernels"])
def test_inproc_workers_share_the_kernels(tmp_path, split):
    metrics = tmp_path / "run.jsonl"
    args = ("--steps", "3", "--transport", "inproc", "--workers", "2", "--split", split, "--metrics-out", str(metrics))
    out = run_example(*SMOKE, *args)
    assert out.returncode == 0, out.stderr
    events = read_metrics(metrics)
    run = events[0]
    assert run["transport"] == "inproc" and len(run["workers"]) == 2
    steps = [e for e in events if e["event"] == "step"]
    for s in steps:
        assert sum(s["shares"]["conv1"]) == 4 and sum(s["shares"]["conv2"]) == 8
        assert len(s["shares"]["conv2"]) == 3  # the master and two workers
        assert s["conv_s"] > 0 and s["bytes_sent"] > 0 and s["bytes_recv"] > 0
        if split == "kernels":
            assert s["channel_shares"] == {}
        else:  # auto with two workers: conv2 (conv1 has no dX) by its 4 input channels
            assert list(s["channel_shares"]) == ["conv2"] and sum(s["channel_shares"]["conv2"]) == 4


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found.append(cmd)
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to look for left-over worker processes")
def test_zmq_workers_run_and_leave_nothing_behind(tmp_path):
    sock = f"ipc:///tmp/tinyconv-test-{uuid.uuid4().hex[:12]}.sock"  # ipc paths must stay short
    metrics = tmp_path / "run.jsonl"
    out = run_example(
        *SMOKE, "--steps", "3", "--transport", "zmq", "--workers", "2", "--bind", sock, "--metrics-out", str(metrics)
    )
    assert out.returncode == 0, out.stderr
    events = read_metrics(metrics)
    assert events[0]["transport"] == "zmq" and len(events[0]["workers"]) == 2
    assert any(e["event"] == "calibration" for e in events)
    assert _processes_with(sock) == []  # every local worker exited with the master


def test_missing_data_is_one_clear_message(tmp_path):
    out = run_example("--dataset", "cifar10", "--data-dir", str(tmp_path / "nowhere"), "--no-download", "--steps", "1")
    assert out.returncode == 2
    assert "error:" in out.stderr and "Traceback" not in out.stderr
    assert "cifar-10" in out.stderr.lower()


def test_unknown_backend_lists_the_choices():
    out = run_example(*SMOKE, "--backend", "cuda", "--steps", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "available: " in out.stderr and "numpy" in out.stderr


def test_a_worker_that_dies_before_hello_is_a_clear_error():
    out = run_example(
        *SMOKE,
        "--steps",
        "1",
        "--transport",
        "zmq",
        "--workers",
        "1",
        "--worker-backend",
        "nosuch",
        "--start-timeout",
        "8",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "died before saying hello" in out.stderr and "exited with code 1" in out.stderr
    assert "unknown backend 'nosuch'" in out.stderr  # the worker's own message reaches the user


def test_ctrl_c_stops_the_run_and_its_workers():
    import selectors
    import signal
    import time

    sock = f"ipc:///tmp/tinyconv-test-{uuid.uuid4().hex[:12]}.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLE),
            "--no-progress",
            *SMOKE,
            "--epochs",
            "50",
            "--transport",
            "zmq",
            "--workers",
            "2",
            "--bind",
            sock,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        # read the master's output until the workers are calibrated, i.e. it is training
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 120
        seen = ""
        while "calibrated shares" not in seen:
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(timeout=left), f"no calibration within 120 s: {seen}"
            line = proc.stdout.readline()
            assert line, proc.communicate()[1]
            seen += line
        assert len(_processes_with(sock)) == 3  # the master and its two workers
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err
    assert _processes_with(sock) == []


def test_opencl_master_and_worker_match_the_numpy_losses(tmp_path):
    """The main job's configuration (zmq, opencl) learns the same as the numpy reference.

    Tolerance: relative 1e-3 on each step's loss. Both compute in float32 but sum in
    different orders (tiled GEMM, split kernels), and three SGD steps amplify the
    ~1e-6 per-op differences; a wrong op would be off by far more.
    """
    pytest.importorskip("pyopencl")
    from backends.opencl import NoOpenCLDevice, OpenCLBackend

    try:
        OpenCLBackend()
    except NoOpenCLDevice as e:
        pytest.skip(str(e))
    common = (*SMOKE, "--steps", "3", "--no-augment")
    ref, ocl = tmp_path / "numpy.jsonl", tmp_path / "opencl.jsonl"
    out = run_example(*common, "--workers", "0", "--metrics-out", str(ref))
    assert out.returncode == 0, out.stderr
    out = run_example(
        *common,
        "--backend",
        "opencl",
        "--transport",
        "zmq",
        "--workers",
        "1",
        "--worker-backend",
        "opencl",
        "--metrics-out",
        str(ocl),
    )
    assert out.returncode == 0, out.stderr
    events = read_metrics(ocl)
    assert events[0]["backend"]["backend"] == "opencl" and events[0]["workers"][0]["backend"] == "opencl"
    losses = [[e["loss"] for e in read_metrics(p) if e["event"] == "step"] for p in (ref, ocl)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-3)
