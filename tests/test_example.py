"""The main job, examples/cifar10_dist.py, end to end as a user runs it (small synthetic runs)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tinyconv.checkpoint import read_checkpoint
from tinyconv.commands import train, train_checks
from tinyconv.metrics import read_metrics
from tinyconv.trainer import Trainer
from transports.session.settings import SECRET_ENV

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
    flags = ("--transport", "--workers", "--backend", "--arch", "--steps", "--split", "--metrics-out", "--resume")
    flags += ("--checkpoint", "--checkpoint-every", "--checkpoint-minutes", "--plan")
    for flag in flags:
        assert flag in out.stdout
    for plan in ("adaptive:", "fixed:", "equal:"):
        assert plan in out.stdout


def test_master_alone_runs_and_writes_metrics(tmp_path):
    metrics = tmp_path / "run.jsonl"
    out = run_example(*SMOKE, "--steps", "5", "--workers", "0", "--metrics-out", str(metrics))
    assert out.returncode == 0, out.stderr
    assert "Summary" in out.stdout and "test accuracy" in out.stdout
    events = read_metrics(metrics)
    assert events[0]["event"] == "run" and events[0]["transport"] is None and events[0]["workers"] == []
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert [e["event"] for e in events[-2:]] == ["epoch", "summary"]


def test_evaluation_batches_larger_than_trainings_reach_the_workers(tmp_path):
    # evaluation runs 500 images at a time: conv2's partial sums (500, 64, 16, 16) are 32 MiB, where
    # training's batch of 8 would cap a message near 1 MiB -- the cap follows the largest batch
    metrics = tmp_path / "run.jsonl"
    args = ("--dataset", "synthetic", "--arch", "8:64", "--batch-size", "8", "--steps", "2", "--transport", "zmq")
    out = run_example(*args, "--workers", "2", "--split", "channels", "--metrics-out", str(metrics))
    assert out.returncode == 0, out.stderr
    assert "lost" not in out.stdout + out.stderr
    events = read_metrics(metrics)
    assert not [e for e in events if e["event"] == "worker_lost"]
    assert events[-1]["final_shares"]["conv2"] and len(events[-1]["final_shares"]["conv2"]) == 3


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


def test_the_run_says_what_it_does_and_its_summary_reads_as_words(tmp_path):
    # conv1 has 2 kernels for 3 participants: one of them must sit it out, and the summary says who and why
    metrics = tmp_path / "run.jsonl"
    args = ("--dataset", "synthetic", "--arch", "2:8", "--batch-size", "32", "--steps", "3", "--workers", "2")
    out = run_example(*args, "--split", "kernels", "--metrics-out", str(metrics))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "loading synthetic ..." and lines[1] == "synthetic: 2,048 training and 512 test images"
    assert any(line.startswith("calibrating: timing master, worker0, worker1") for line in lines)
    summary = read_metrics(metrics)[-1]
    (sat,) = summary["sat_out"]
    assert (sat["layer"], sat["steps"], sat["reason"]) == ("conv1", 3, "too few kernels")
    who = sat["participant"]
    assert (
        "| sat out " in out.stdout
        and f"{who} sat out conv1 in every step: conv1 has 2 kernels for 3 participants" in out.stdout
    )
    named = zip(summary["participants"], summary["final_shares"]["conv1"], strict=True)
    shares = ", ".join(f"{n} {c}" for n, c in named)
    assert f"conv1: {shares};" in out.stdout and f"{who} 0" in shares  # by name, not a bare list
    projected = [line for line in lines if "time per epoch (projected from 3 steps)" in line]
    assert len(projected) == 1 and projected[0].rstrip(" |").endswith(" s")  # 64 steps an epoch here
    assert summary["time_per_epoch_s"] is None  # the file keeps what was measured: no whole epoch


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
    assert "--backend cuda: not one of " in out.stderr and "numpy" in out.stderr


def test_a_worker_that_dies_before_hello_is_a_clear_error():
    t0 = time.monotonic()
    # a device no machine has: the options pass the master's checks (opencl has devices), the worker cannot start
    args = ("--steps", "1", "--transport", "zmq", "--workers", "1", "--worker-backend", "opencl")
    out = run_example(*SMOKE, *args, "--worker-device", "nosuchdevice", "--start-timeout", "300")
    assert time.monotonic() - t0 < 60  # the worker's exit ends the wait, not the 300 s timeout
    assert out.returncode == 1 and "Traceback" not in out.stderr  # a failure during the run, not a usage error
    assert "died before saying hello" in out.stderr and "exited with code 1" in out.stderr
    assert "'nosuchdevice'" in out.stderr  # the worker's own message reaches the user


def test_ctrl_c_stops_the_run_and_its_workers():
    import selectors

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


# ---- nothing lost on the way out ------------------------------------------------------------------
def steps_of(path: Path) -> list[dict]:
    return [e for e in read_metrics(path) if e["event"] == "step"]


@contextlib.contextmanager
def running_example(*args: str) -> Iterator[subprocess.Popen]:
    """The main job in a process of its own (its output unbuffered, piped), killed if the test leaves it running."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, str(EXAMPLE), "--no-progress", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_until(proc: subprocess.Popen, done: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Until ``done()``: polling a file the run writes, whose contents are the synchronisation."""
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"no {what} within the timeout"
        time.sleep(0.02)


def wait_for_a_step(proc: subprocess.Popen, metrics: Path) -> None:
    """Until the run's metrics file holds a step line: it is training."""
    wait_until(proc, lambda: metrics.exists() and '"event": "step"' in metrics.read_text(), "step")


@pytest.mark.parametrize(
    ("signum", "code", "said"), [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_signal_checkpoints_the_last_step_and_the_run_resumes_without_duplicates(tmp_path, signum, code, said):
    metrics, ck = tmp_path / "run.jsonl", tmp_path / "run.npz"
    common = (*SMOKE, "--workers", "0", "--epochs", "50", "--checkpoint", str(ck), "--metrics-out", str(metrics))
    with running_example(*common) as proc:
        wait_for_a_step(proc, metrics)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and said in err and "Traceback" not in err, err
    step = read_checkpoint(ck).meta["step"]
    assert step >= 1 and [e["step"] for e in steps_of(metrics)] == list(range(1, step + 1))
    assert f"last checkpoint: step {step} in {ck}; continue with --resume {ck}" in err
    out = run_example(*common, "--resume", str(ck), "--steps", str(step + 2))
    assert out.returncode == 0, out.stderr
    assert f"resumed from {ck} at step {step}" in out.stdout
    assert [e["step"] for e in steps_of(metrics)] == list(range(1, step + 3))


def test_sigterm_while_waiting_for_workers_ends_with_a_message(tmp_path):
    # before training starts the trainer holds no signal: the command's own guard turns SIGTERM into 143
    external = ("--transport", "zmq", "--external-workers", "--workers", "1", "--bind", "tcp://127.0.0.1:0")
    with running_example(*SMOKE, *external) as proc:
        for line in proc.stdout:  # the waiting line is the synchronisation
            if line.startswith("waiting for 1 worker"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err and "Traceback" not in err, err


def test_a_supervised_master_killed_mid_run_comes_back_from_its_checkpoint(tmp_path):
    metrics, ck = tmp_path / "run.jsonl", tmp_path / "run.npz"
    supervised = ("--steps", "300", "--checkpoint", str(ck), "--metrics-out", str(metrics), "--max-restarts", "2")
    with running_example(*SMOKE, "--workers", "0", "--checkpoint-every", "1", *supervised) as proc:
        first = proc.stdout.readline()
        assert first.startswith("supervisor: training in process "), first
        wait_until(proc, ck.exists, "checkpoint")  # the first checkpoint, after the first step
        os.kill(int(first.split()[-1]), signal.SIGKILL)  # the master, not its supervisor
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "supervisor: training died (exit 137); restart 1 of 2" in out
    assert f"resumed from {ck}" in out
    assert [e["step"] for e in steps_of(metrics)] == list(range(1, 301))  # every step once, none twice


def test_sigterm_to_the_supervisor_stops_the_run_as_it_stops_an_unsupervised_one(tmp_path):
    metrics, ck = tmp_path / "run.jsonl", tmp_path / "run.npz"
    supervised = ("--steps", "300", "--checkpoint", str(ck), "--metrics-out", str(metrics), "--max-restarts", "2")
    with running_example(*SMOKE, "--workers", "0", *supervised) as proc:
        wait_for_a_step(proc, metrics)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "stopped by SIGTERM" in err and "restart" not in out, err
    assert f"continue with --resume {ck}" in err


def announced_secret(proc: subprocess.Popen) -> str:
    """The join secret in the command a master waiting for external workers prints."""
    for line in proc.stdout:  # the waiting line, then the command: the synchronisation
        if found := re.search(rf"{SECRET_ENV}=(\w+) tinyconv worker", line):
            return found[1]
    pytest.fail(f"no command with a join secret: {proc.communicate()[1]}")


def test_a_join_secret_given_is_the_masters_and_a_supervisor_keeps_one_for_every_restart(tmp_path, monkeypatch):
    """So that external workers on loopback rejoin a master resumed (given the secret) or restarted."""
    external = (*SMOKE, "--transport", "zmq", "--external-workers", "--workers", "1", "--bind", "tcp://127.0.0.1:0")
    monkeypatch.setenv(SECRET_ENV, "given")
    with running_example(*external) as proc:
        assert announced_secret(proc) == "given"
    monkeypatch.delenv(SECRET_ENV)
    supervised = ("--checkpoint", str(tmp_path / "c.npz"), "--max-restarts", "1")
    with running_example(*external, *supervised) as proc:
        first = proc.stdout.readline()
        secret = announced_secret(proc)
        os.kill(int(first.split()[-1]), signal.SIGKILL)  # the master, not its supervisor
        assert announced_secret(proc) == secret  # the restarted master's, the one its workers have
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143


def test_insecure_is_said_at_start_and_in_the_plan_line():
    out = run_example(*SMOKE, "--transport", "zmq", "--workers", "1", "--steps", "1", "--insecure")
    assert out.returncode == 0, out.stderr
    assert "warning: --insecure: workers join without keys" in out.stderr
    plan = next(line for line in out.stdout.splitlines() if line.startswith("plan: "))
    assert plan.endswith("-- INSECURE: workers join without keys")
    assert "INSECURE" not in run_example(*SMOKE, "--workers", "0", "--steps", "1").stdout


def test_a_run_that_ends_as_asked_is_not_restarted(tmp_path):
    out = run_example(*SMOKE, "--workers", "0", "--steps", "2", "--checkpoint", str(tmp_path / "c.npz"),
                      "--max-restarts", "3")  # fmt: skip
    assert out.returncode == 0 and out.stdout.count("supervisor: training in process") == 1, out.stderr
    refused = run_example(*SMOKE, "--workers", "0", "--max-restarts", "3")
    assert refused.returncode == 2 and "--max-restarts restarts training from its checkpoint" in refused.stderr


@pytest.fixture(scope="module")
def example():
    """The main job's entry point, tinyconv/commands/train.py (examples/cifar10_dist.py and `tinyconv train` run it)."""
    return train


@pytest.fixture
def main(example, monkeypatch):
    """The main job in this process (glibc's malloc left as it is)."""
    monkeypatch.setenv("TINYCONV_KEEP_FREED_MEMORY", "0")
    return lambda *args: example.main(["--no-progress", *args])


def fail_after(monkeypatch, step: int) -> None:
    """Make the step after ``step`` fail once its forward and backward are done, as a lost worker would."""
    real = Trainer._forward_backward

    def failing(self, xb, yb):
        out = real(self, xb, yb)
        if self.step == step:
            raise RuntimeError(f"injected: worker 1 lost in step {step + 1}")
        return out

    monkeypatch.setattr(Trainer, "_forward_backward", failing)


INPROC = (*SMOKE, "--norm", "batch", "--transport", "inproc", "--workers", "2", "--steps", "6")


def test_same_seed_same_plan_and_a_resume_after_an_error_give_bit_identical_losses(main, tmp_path, monkeypatch, capsys):
    """--plan equal: the same split on every run. A run, the same run again, and one that fails in its
    4th step (batch norm's statistics and the augmentation moved) and resumes from its checkpoint."""
    a, a2, b, ck = (tmp_path / n for n in ("a.jsonl", "a2.jsonl", "b.jsonl", "b.npz"))
    assert main(*INPROC, "--plan", "equal", "--metrics-out", str(a)) == 0
    assert main(*INPROC, "--plan", "equal", "--metrics-out", str(a2)) == 0
    with monkeypatch.context() as m:
        fail_after(m, 3)
        assert main(*INPROC, "--plan", "equal", "--checkpoint", str(ck), "--metrics-out", str(b)) == 1
    err = capsys.readouterr().err
    assert "error: injected: worker 1 lost in step 4" in err and f"last checkpoint: step 3 in {ck}" in err
    assert [e["step"] for e in steps_of(b)] == [1, 2, 3]
    assert main(*INPROC, "--plan", "equal", "--checkpoint", str(ck), "--resume", str(ck), "--metrics-out", str(b)) == 0
    losses = [[e["loss"] for e in steps_of(p)] for p in (a, a2, b)]
    assert len(losses[0]) == 6 and losses[0] == losses[1] == losses[2]  # bit for bit: ==, not approx
    assert [e["step"] for e in steps_of(b)] == [1, 2, 3, 4, 5, 6]
    assert [e["event"] for e in read_metrics(b)].count("run") == 2  # the resumed run's, appended


def test_plan_fixed_resumes_with_the_checkpoints_split(main, tmp_path, monkeypatch, capsys):
    b, ck = tmp_path / "b.jsonl", tmp_path / "b.npz"
    fixed = (*INPROC, "--plan", "fixed", "--checkpoint", str(ck), "--metrics-out", str(b))
    with monkeypatch.context() as m:
        fail_after(m, 3)
        assert main(*fixed) == 1
    saved = read_checkpoint(ck).meta["plan"]
    assert saved["participants"] == ["master", "worker0", "worker1"] and sum(saved["counts"]["conv2"]) == 8
    capsys.readouterr()
    assert main(*fixed, "--resume", str(ck)) == 0
    assert "the checkpoint's split restored (master, worker0, worker1)" in capsys.readouterr().out
    shares = [e["shares"] for e in steps_of(b)]
    assert len(shares) == 6 and all(s == saved["counts"] for s in shares)  # before the error and after the resume
    # other participants: a fixed plan refuses them, an adaptive one says so and goes on
    more = ("--steps", "7", "--workers", "1", "--resume", str(ck))
    assert main(*fixed, *more) == 1
    err = capsys.readouterr().err
    assert "the checkpoint's split is for master, worker0, worker1, this run has master, worker0" in err
    assert "--plan fixed resumes only with its split" in err and err.startswith("error: ")
    assert main(*INPROC, "--plan", "adaptive", "--checkpoint", str(ck), *more) == 0
    assert "this run has master, worker0: keeping this run's split" in capsys.readouterr().out


def test_plan_equal_resumes_with_other_workers_equally(main, tmp_path, monkeypatch, capsys):
    """A restarted master's workers are those that rejoined it: --plan equal splits equally among them."""
    ck = tmp_path / "b.npz"
    equal = (*INPROC, "--plan", "equal", "--checkpoint", str(ck), "--metrics-out", str(tmp_path / "b.jsonl"))
    with monkeypatch.context() as m:
        fail_after(m, 3)
        assert main(*equal) == 1
    capsys.readouterr()
    assert main(*equal, "--workers", "1", "--resume", str(ck)) == 0
    assert "this run has master, worker0: keeping this run's split" in capsys.readouterr().out
    assert steps_of(tmp_path / "b.jsonl")[-1]["shares"]["conv2"] == [4, 4]


def test_resuming_an_older_checkpoint_replaces_the_steps_after_it(main, tmp_path):
    m, ck, ck4 = tmp_path / "m.jsonl", tmp_path / "c.npz", tmp_path / "c4.npz"
    common = (*SMOKE, "--workers", "0", "--schedule", "constant", "--checkpoint", str(ck), "--metrics-out", str(m))
    assert main(*common, "--steps", "4") == 0
    shutil.copy(ck, ck4)
    assert main(*common, "--steps", "7", "--resume", str(ck)) == 0
    first = [e["loss"] for e in steps_of(m)]
    assert main(*common, "--steps", "7", "--resume", str(ck4)) == 0  # steps 5-7 again
    assert [e["step"] for e in steps_of(m)] == [1, 2, 3, 4, 5, 6, 7]
    assert [e["loss"] for e in steps_of(m)] == first


def test_a_run_that_fails_before_its_first_step_leaves_the_metrics_file_alone(main, tmp_path, capsys):
    m, ck = tmp_path / "m.jsonl", tmp_path / "c.npz"
    assert main(*SMOKE, "--workers", "0", "--steps", "3", "--checkpoint", str(ck), "--metrics-out", str(m)) == 0
    with open(m, "a") as f:  # steps beyond the checkpoint, as a killed run leaves them
        f.write('{"event": "step", "step": 4, "loss": 1.0}\n')
    before = m.read_bytes()
    broken = ("--transport", "zmq", "--workers", "1", "--worker-backend", "opencl", "--worker-device", "nosuchdevice")
    broken += ("--metrics-out", str(m))
    assert main(*SMOKE, "--steps", "5", *broken) == 1
    assert main(*SMOKE, "--steps", "5", "--resume", str(ck), *broken) == 1
    assert "'nosuchdevice'" in capsys.readouterr().err
    assert m.read_bytes() == before


def test_local_workers_default_to_one_per_spare_core_and_external_ones_to_two(example, monkeypatch):
    parse = example.build_parser().parse_args
    example = train_checks  # where the checks live
    monkeypatch.setattr(example.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    args = parse([])
    example.check_workers(args)
    assert args.workers == 1  # a second local worker on 2 cores only waits for the first
    monkeypatch.setattr(example.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    args = parse([])
    example.check_workers(args)
    assert args.workers == 1  # at least one: the default run is distributed
    monkeypatch.setattr(example.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    args = parse([])
    example.check_workers(args)
    assert args.workers == 7
    args = parse(["--transport", "zmq", "--external-workers"])
    example.check_workers(args)
    assert args.workers == 2
    args = parse(["--workers", "3"])
    example.check_workers(args)
    assert args.workers == 3
