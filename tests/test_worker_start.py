"""Starting and stopping local worker processes: one that fails at start ends the master's wait at once, in
its own words; one stopped in the middle of a task ends with its own exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from echo_worker import answer

import tinyconv as tc
from tinyconv.distributed.pool import _death_notice, _StderrTail, stop_workers, worker_pool
from tinyconv.distributed.protocol import VERSION
from transports.base import Message
from transports.session.settings import SECRET_ENV
from transports.zmq_master import ZmqTransport


def test_a_local_worker_that_fails_at_start_ends_the_wait_at_once():
    net = tc.paper_net("4:8", "numpy")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        tc.distribute(net, "zmq", 2, worker_backend="nosuch", start_timeout=300, announce=lambda s: None)
    assert time.monotonic() - t0 < 60  # not the 300 s start timeout: it ends when the process does
    text = str(info.value)
    assert "died before saying hello (exited with code 2)" in text  # a usage error: before any work
    assert "--backend nosuch: not one of numpy" in text  # the worker's own message
    assert "\n" not in text


def test_a_workers_stderr_is_kept_and_echoed_once_released(capfd):
    code = "import sys\nfor i in range(10): print('line', i, file=sys.stderr)\nprint(file=sys.stderr)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    tail = _StderrTail(proc)
    proc.wait(timeout=60)
    assert tail.last(3) == ["line 7", "line 8", "line 9"]  # blank lines skipped
    assert "line" not in capfd.readouterr().err  # held until released
    tail.release()
    assert capfd.readouterr().err.count("line") == 10


def test_death_notices():
    assert _death_notice(1, 3, ["Traceback ...", "ImportError: no pyopencl"]) == (
        "local worker 1 died before saying hello (exited with code 3): Traceback ... | ImportError: no pyopencl"
    )
    assert (
        _death_notice(0, -9, [])
        == "local worker 0 died before saying hello (was killed by SIGKILL) without a word on stderr"
    )


def _cpu_seconds(pid: int) -> float:
    """The user + system CPU time a process has used (Linux's /proc): only its compute thread uses much."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.01)


def _replica_calibrate(task: int, arch: str, batch: int, repeats: int) -> Message:
    net = {"arch": arch, "norm": "lrn", "pool_kernel": 3, "num_classes": 10, "in_channels": 3, "image_size": 32}
    return Message("replica_calibrate", {"task": task, "net": net, "batch": batch, "repeats": repeats})


def test_a_worker_stopped_in_the_middle_of_a_task_exits_with_its_code_not_a_segfault():
    """SIGTERM while the compute thread is in a long task (its GEMMs): a plain exit ran OpenBLAS's clean-up
    under the running GEMM and the worker died of SIGSEGV; now it ends with 130 and says why."""
    with ZmqTransport(bind="tcp://127.0.0.1:0", protocol=VERSION, heartbeat_s=0.2, peer_timeout_s=10.0) as transport:
        connect = transport.bound_address
        cmd = [sys.executable, "-m", "tinyconv.distributed.worker", "--connect", connect, "--threads", "1"]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        try:
            (worker,) = transport.start(1, timeout=60)
            transport.send(worker.index, _replica_calibrate(1, "4:8", 2, 1))  # short
            _, reply = answer(transport, 60)
            assert reply.kind == "result" and reply.header["task"] == 1  # the compute thread is up
            busy_from = _cpu_seconds(proc.pid)
            transport.send(worker.index, _replica_calibrate(2, "64:256", 32, 1000))  # minutes of GEMMs
            _wait_until(lambda: _cpu_seconds(proc.pid) > busy_from + 0.5, timeout=60)  # computing task 2 now
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, f"exit {proc.returncode}: {err}"
    assert "interrupted; worker stopping" in err and "the task in course is left unfinished" in err


def test_external_workers_on_loopback_without_keys_are_told_the_runs_join_secret():
    """No other local user can join: the command the master announces sets a per-run secret, and a worker
    started without it is refused while the one run as announced is admitted."""
    said, procs = [], []

    def announce(line: str) -> None:
        said.append(line)
        command = line.split("\n")[-1].split()
        env_part, connect = command[0], command[command.index("--connect") + 1]
        assert env_part.startswith(f"{SECRET_ENV}=") and len(env_part.split("=")[1]) == 32, line
        worker = [sys.executable, "-m", "tinyconv.cli", "worker", "--connect", connect, "--retry-for", "5"]
        procs.append(subprocess.Popen(worker, stderr=subprocess.PIPE, text=True))  # no secret: refused
        secret = dict([env_part.split("=", 1)])
        procs.append(subprocess.Popen(worker, env={**os.environ, **secret}, stderr=subprocess.PIPE, text=True))

    pool = worker_pool("zmq", 1, external=True, bind="tcp://127.0.0.1:0", announce=announce, start_timeout=60)
    try:
        with pool as (transport, infos):
            assert [i.pid for i in infos] == [procs[1].pid]
            _, err = procs[0].communicate(timeout=60)
            assert procs[0].returncode != 0 and "admits only the workers it started or gave its join secret" in err
    finally:
        stop_workers(procs)
    assert len(said) == 1
