"""benchmarks/throttled_link.py: the options it appends (anywhere), and with root, ip and tc a real
shaped veth pair: its rate, a command run across it, and no namespace left behind, even on SIGTERM.
Each run names its namespaces after this process, so parallel runs do not meet."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "throttled_link.py"
spec = importlib.util.spec_from_file_location("throttled_link", SCRIPT)
tl = sys.modules["throttled_link"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tl)

needs_root = pytest.mark.skipif(tl.unavailable() is not None, reason=f"throttled links: {tl.unavailable()}")


def test_the_appended_options():
    names = tl.Names("-t")
    cmd = tl.appended(["tinyconv", "experiment", "grid", "--arch", "300:1000"], names, 5555, "5MB/s")
    assert cmd == ["ip", "netns", "exec", "tinyconv-m-t", "tinyconv", "experiment", "grid", "--arch", "300:1000",
                   "--bind", "tcp://10.77.0.1:5555", "--worker-prefix", "ip netns exec tinyconv-w-t",
                   "--link-label", "5MB/s"]  # fmt: skip


def test_a_command_that_starts_with_grid_is_this_pythons_experiment_grid():
    grid = tl.expand(["grid", "--rebalance", "off", "--wire-precision", "fp32", "bf16"])
    assert grid == [sys.executable, "-m", "tinyconv.cli", "experiment", "grid", "--rebalance", "off",
                    "--wire-precision", "fp32", "bf16"]  # fmt: skip
    assert tl.expand(["tinyconv", "experiment", "grid"]) == ["tinyconv", "experiment", "grid"]  # others as they are
    assert tl.expand(["python", "grid"]) == ["python", "grid"]
    cmd = tl.appended(grid, tl.Names("-t"), 5555, "5MB/s")
    assert cmd[:4] == ["ip", "netns", "exec", "tinyconv-m-t"] and cmd[4:9] == tl.GRID
    assert cmd[-6:] == ["--bind", "tcp://10.77.0.1:5555", "--worker-prefix", "ip netns exec tinyconv-w-t",
                        "--link-label", "5MB/s"]  # fmt: skip


def test_tbf_takes_bits_and_a_burst():
    assert tl.tbf(5e6)[:4] == ["tbf", "rate", "40000000bit", "burst"]
    assert int(tl.tbf(5e6)[4]) == 100_000 and int(tl.tbf(1e6)[4]) == 64_000


@pytest.fixture
def names():
    names = tl.Names(f"-{os.getpid()}")
    yield names
    tl.teardown(names)  # also when the test failed
    assert tl.exists(names) == []


@needs_root
def test_the_shaped_link_carries_its_rate(names):
    """A rate check of tc's shaping (not a timing of our code): 2 MB at 2 MB/s, under the rate and a margin."""
    try:
        tl.setup(names, 2e6)
    except RuntimeError as e:  # root without CAP_SYS_ADMIN (a container), say
        pytest.skip(f"cannot make namespaces here: {e}")
    assert sorted(tl.exists(names)) == sorted([names.master, names.worker])
    got = tl.measure(names, 2_000_000, port=5599)
    assert 0 < got < 2e6 * 1.25
    tl.teardown(names)
    assert tl.exists(names) == []


@needs_root
def test_a_command_runs_in_the_master_namespace_and_everything_goes(names):
    code = "import socket, sys; print(sys.argv[1:]); socket.create_server(('10.77.0.1', 0)); sys.exit(3)"
    out = subprocess.run([sys.executable, str(SCRIPT), "--rate", "100MB/s", "--suffix", names.suffix, "--",
                          sys.executable, "-c", code], capture_output=True, text=True, timeout=60)  # fmt: skip
    if "cannot" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 3, out.stderr  # the command's status; it could bind the master's address
    assert f"'--worker-prefix', 'ip netns exec {names.worker}'" in out.stdout
    assert tl.exists(names) == []


@needs_root
def test_sigterm_tears_down(names):
    code = "print('started', flush=True); import sys; sys.stdin.read()"  # waits for us
    cmd = [sys.executable, str(SCRIPT), "--rate", "100MB/s", "--suffix", names.suffix, "--", sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if line.strip() != "started":
            pytest.skip("the link could not be made here")
        assert tl.exists(names)
        proc.terminate()
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert tl.exists(names) == []


def test_without_root_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(tl, "unavailable", lambda: "needs root")
    assert tl.main(["--rate", "5MB/s", "--check"]) == 1
    assert "needs root" in capsys.readouterr().err


@needs_root
def test_a_real_worker_in_one_namespace_serves_a_master_in_the_other(names):
    """--check-worker: a tinyconv worker in the workers' namespace, one training step of a tiny network."""
    cmd = [sys.executable, str(SCRIPT), "--rate", "100MB/s", "--suffix", names.suffix, "--check-worker"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if "cannot" in out.stderr or "Operation not permitted" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stderr
    assert "master tcp://10.77.0.1:" in out.stdout and "worker at 10.77.0.2" in out.stdout
    assert tl.exists(names) == []


@needs_root
def test_a_grid_with_a_fixed_split_and_a_narrowed_wire_runs_across_the_link(names, tmp_path):
    """``-- grid ...``: the experiment grid in the master's namespace, its worker in the other, one cell."""
    out = tmp_path / "link.csv"
    grid = ["grid", "--arch", "4:8", "--batch-size", "4", "--workers", "1", "--split", "kernels", "--rebalance", "off"]
    grid += ["--wire-precision", "bf16", "--timed-steps", "1", "--untimed-steps", "0", "--settle", "0"]
    cmd = [sys.executable, str(SCRIPT), "--rate", "100MB/s", "--suffix", names.suffix, "--", *grid]
    cmd += ["--no-progress", "--out", str(out)]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=SCRIPT.parent.parent)
    if "cannot" in got.stderr or "Operation not permitted" in got.stderr:
        pytest.skip(got.stderr.strip())
    assert got.returncode == 0, got.stderr
    (row,) = list(csv.DictReader(out.open()))
    assert (row["link"], row["rebalance"], row["wire"], row["split"]) == ("100MB/s", "off", "bf16", "kernels")
    assert int(row["bytes_sent"]) > 0 and row["wire_formats"] == "conv1=bf16/bf16/bf16 conv2=bf16/bf16/bf16"
    assert tl.exists(names) == []


def test_a_master_waiting_for_external_workers_gets_its_bind_and_a_worker_across_the_link():
    names = tl.Names("-t")
    master, worker = tl.with_workers(["python", "examples/cifar10_dist.py", "--external-workers"], names, 5555)
    assert master == ["ip", "netns", "exec", names.master, "python", "examples/cifar10_dist.py",
                      "--external-workers", "--bind", "tcp://10.77.0.1:5555"]  # fmt: skip
    assert worker[:4] == ["ip", "netns", "exec", names.worker] and worker[-5:-2] == [
        "worker",
        "--connect",
        "tcp://10.77.0.1:5555",
    ]
