"""tinyconv/lab/experiment/cpu_quota.py: which controller it finds and what it writes (anywhere), and with root and a
mounted cpu controller a real quota: a busy loop at half a core gets at most about half the wall time, by the
kernel's own accounting, and no group is left behind. Each group is named after this process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tinyconv.lab.experiment import cpu_quota as cq

needs_root = pytest.mark.skipif(cq.unavailable() is not None, reason=f"CPU quotas: {cq.unavailable()}")

V1_MOUNTS = """tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_a_hybrid_machine_uses_v1s_cpu_and_a_v2_with_cpu_wins():
    assert cq.find_controller(V1_MOUNTS, v2_controllers="hugetlb") == cq.Controller(1, Path("/sys/fs/cgroup/cpu"))
    v2 = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
    assert cq.find_controller(v2, v2_controllers="cpuset cpu io memory pids") == cq.Controller(
        2, Path("/sys/fs/cgroup")
    )
    assert cq.find_controller(v2 + V1_MOUNTS, v2_controllers="cpu") == cq.Controller(2, Path("/sys/fs/cgroup"))
    assert cq.find_controller("cgroup /sys/fs/cgroup/cpuacct cgroup rw,cpuacct 0 0\n", v2_controllers="") is None
    both = "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n"  # v1 with the two joined, as many distros
    assert cq.find_controller(both, v2_controllers="") == cq.Controller(1, Path("/sys/fs/cgroup/cpu,cpuacct"))


def test_the_quota_files():
    assert cq.quota_files(1, 0.5) == {"cpu.cfs_period_us": "10000", "cpu.cfs_quota_us": "5000"}
    assert cq.quota_files(2, 0.5) == {"cpu.max": "5000 10000"}
    assert cq.quota_files(2, 1.5, period_us=20_000) == {"cpu.max": "30000 20000"}
    assert cq.quota_files(1, 0.001)["cpu.cfs_quota_us"] == "1000"  # the kernel's least
    with pytest.raises(ValueError, match="cores must be > 0"):
        cq.quota_files(1, 0)


def test_the_prefix_puts_the_shell_in_the_group_and_execs_the_command(tmp_path):
    q = cq.CpuQuota(0.5, name="g", controller=cq.Controller(1, tmp_path))
    (tmp_path / "g").mkdir()
    got = subprocess.run([*q.prefix(), sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert (tmp_path / "g" / "cgroup.procs").read_text().strip() == got.stdout.strip()  # exec: the same pid


def test_without_root_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cq, "unavailable", lambda: "needs root")
    assert cq.main(["--cores", "0.5", "--", "true"]) == 1
    assert "needs root" in capsys.readouterr().err


BUSY = "import time\nwhile time.process_time() < 0.6:\n    pass\n"  # 0.6 s of CPU, however long that takes


@needs_root
def test_a_busy_loop_at_half_a_core_gets_at_most_about_half_the_wall_time():
    """Bounds the quota enforces whatever the load: 0.6 s of CPU at 5 ms per 10 ms period takes at least
    1.19 s of wall time, so CPU / wall <= 0.51 (0.6 leaves room for the kernel's accounting); a loaded machine
    only lowers it. The CPU time is the kernel's
    (the child's rusage)."""
    with cq.CpuQuota(0.5, name=f"tinyconv-cpu-test-{os.getpid()}") as q:
        for name, value in q.files.items():
            assert (q.path / name).read_text().strip() == value
        start = time.monotonic()
        proc = subprocess.Popen([*q.prefix(), sys.executable, "-c", BUSY])
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0
        cpu = usage.ru_utime + usage.ru_stime
        assert 0.6 <= cpu and cpu / wall < 0.6, (cpu, wall)
        assert q.stat()["nr_periods"] > 0  # the group ran under its quota
    assert not q.path.exists()


@needs_root
def test_the_command_line_runs_the_command_limited_and_removes_the_group():
    code = "import sys; sys.exit(4)"
    module = ["-m", "tinyconv.lab.experiment.cpu_quota"]
    cmd = [sys.executable, *module, "--cores", "0.5", "--", sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err
    assert "0.5 core(s), throttled in" in err
    assert not (cq.find_controller(Path("/proc/mounts").read_text()).root / f"tinyconv-cpu-{proc.pid}").exists()


@needs_root
def test_a_process_knows_the_quota_it_runs_in():
    code = "from tinyconv.lab.experiment.cpu_quota import own_cores; print(own_cores())"
    with cq.CpuQuota(0.25, name=f"tinyconv-cpu-own{os.getpid()}") as q:
        got = subprocess.run([*q.prefix(), sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "0.25"
