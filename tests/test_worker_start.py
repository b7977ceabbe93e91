"""Starting local worker processes: one that fails at start ends the master's wait at once, in its own words."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import tinyconv as tc
from tinyconv.pool import _death_notice, _StderrTail


def test_a_local_worker_that_fails_at_start_ends_the_wait_at_once():
    net = tc.paper_net("4:8", "numpy")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        tc.distribute(net, "zmq", 2, worker_backend="nosuch", start_timeout=300, announce=lambda s: None)
    assert time.monotonic() - t0 < 60  # not the 300 s start timeout: it ends when the process does
    text = str(info.value)
    assert "died before saying hello (exited with code 1)" in text
    assert "unknown backend 'nosuch'" in text  # the worker's own message
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
