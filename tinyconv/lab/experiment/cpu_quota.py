"""Run a command on a fraction of one core: a cgroup with a CPU quota (the kernel's CFS bandwidth control).

    sudo .venv/bin/python -m tinyconv.lab.experiment.cpu_quota --cores 0.5 -- .venv/bin/tinyconv worker ...
    sudo .venv/bin/python -m tinyconv.lab.experiment.cpu_quota --cores 0.5 -- ip netns exec tinyconv-w ...

The experiment grid's emulated devices (``tinyconv experiment grid --cpu-quota 0.5 0.5 0.5 0.5``) are such
groups, one per participant, the master's own process included (:meth:`CpuQuota.holding`).

``--slowdown 2`` makes a worker wait after its work; a quota makes its work itself take longer, as a slower
device's would: in every period the group may run for ``cores`` x period of CPU time, and then waits for the
next period. The period is 10 ms, not the kernel's default 100 ms: a worker's task is a burst (25 ms of a 70 ms
step, say), and with 100 ms periods a burst that fits in the quota (50 ms at half a core) runs at full speed --
the group is held only to its average. With 10 ms periods (twice the kernel's 5 ms bandwidth slice) every burst
longer than a few ms is paused in step, so it takes about 1 / ``cores`` as long. This makes a group
``tinyconv-cpu-PID`` under the cpu controller's hierarchy:

* cgroup v2 (``cgroup2`` mounted with ``cpu`` among its controllers): ``cpu.max`` = "QUOTA PERIOD" in
  microseconds, in a group under the hierarchy's root (whose ``cgroup.subtree_control`` gets ``+cpu``);
* cgroup v1 (the ``cpu`` controller mounted on its own, as on the development VM at /sys/fs/cgroup/cpu):
  ``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``.

A command joins the group through :meth:`CpuQuota.prefix`, a ``sh`` that writes its own pid into the group's
``cgroup.procs`` and then execs the command; whatever it starts stays in the group. Put the prefix *before*
``ip netns exec`` (which mounts a fresh /sys, hiding the cgroup files), not after it. On exit -- the command's
end, an error, Ctrl-C -- any process still in the group is moved back to the root group and the group is
removed. Needs root and a mounted cpu controller; without them it says why and exits 1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 10_000  # see the module docstring


@dataclass(frozen=True)
class Controller:
    """Where the cpu controller is: cgroup ``version`` 1 or 2, its hierarchy mounted at ``root``."""

    version: int
    root: Path


def find_controller(mounts: str, v2_controllers: str | None = None) -> Controller | None:
    """The cpu controller in /proc/mounts' text: v2 if a cgroup2 mount lists ``cpu`` among its controllers
    (``v2_controllers``: that mount's cgroup.controllers, read here when None), else a v1 ``cpu`` mount."""
    v1 = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        where, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup2":
            listed = v2_controllers if v2_controllers is not None else _read(where / "cgroup.controllers")
            if "cpu" in listed.split():
                return Controller(2, where)
        elif kind == "cgroup" and "cpu" in options and v1 is None:
            v1 = Controller(1, where)
    return v1


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def quota_files(version: int, cores: float, period_us: int = PERIOD_US) -> dict[str, str]:
    """The files (and their contents) that hold a group to ``cores`` of one core: 0.5 -> 5 ms every 10 ms."""
    if not cores > 0:
        raise ValueError(f"cores must be > 0 (a fraction of one core, or more), got {cores!r}")
    quota = max(1000, round(cores * period_us))  # the kernel's least quota is 1 ms
    if version == 2:
        return {"cpu.max": f"{quota} {period_us}"}
    return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota)}


def unavailable() -> str | None:
    """Why this machine cannot limit a process's CPU, or None."""
    if not sys.platform.startswith("linux"):
        return "cgroups need Linux"
    if os.geteuid() != 0:
        return "needs root (making a cgroup and writing its CPU quota): run it with sudo"
    if find_controller(_read(Path("/proc/mounts"))) is None:
        return "no cgroup cpu controller is mounted (neither v2 with cpu in cgroup.controllers nor v1's cpu)"
    return None


def own_cores(pid: int | None = None) -> float | None:
    """The CPU quota, in cores, of the group process ``pid`` (this one by default) is in; None where it has
    none (or no cpu controller is mounted): what a device measured inside ``--cores 0.5`` records."""
    found = find_controller(_read(Path("/proc/mounts")))
    if found is None or not sys.platform.startswith("linux"):
        return None
    group = CpuQuota.group_of(found, os.getpid() if pid is None else pid)
    if found.version == 2:
        quota, _, period = _read(group / "cpu.max").partition(" ")
    else:
        quota, period = _read(group / "cpu.cfs_quota_us"), _read(group / "cpu.cfs_period_us")
    try:
        q, t = int(quota), int(period)
    except ValueError:  # "max" (v2) or unreadable: no quota
        return None
    return q / t if q > 0 and t > 0 else None  # v1 says -1 for none


class CpuQuota:
    """A cgroup holding its processes to ``cores`` of one core, removed on exit (a context manager)::

    with CpuQuota(0.5) as q:
        subprocess.run([*q.prefix(), "python", "work.py"])
        print(q.stat()["nr_throttled"])  # periods in which the group ran out of its quota
    """

    def __init__(
        self, cores: float, name: str | None = None, controller: Controller | None = None, period_us: int = PERIOD_US
    ):
        found = controller or find_controller(_read(Path("/proc/mounts")))
        if found is None:
            raise RuntimeError("no cgroup cpu controller is mounted")
        self.controller, self.cores = found, cores
        self.path = found.root / (name or f"tinyconv-cpu-{os.getpid()}")
        self.files = quota_files(found.version, cores, period_us)

    def __enter__(self) -> CpuQuota:
        try:
            if self.controller.version == 2:
                (self.controller.root / "cgroup.subtree_control").write_text("+cpu")
            self.path.mkdir()
            for name, value in self.files.items():
                (self.path / name).write_text(value)
        except OSError as e:
            self.remove()
            raise RuntimeError(f"cannot make the cgroup {self.path}: {e}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @contextmanager
    def holding(self, pid: int) -> Iterator[None]:
        """The running process ``pid`` (all its threads, and what it starts meanwhile) in the group for the
        duration, then back in the group it was in."""
        home = self.group_of(self.controller, pid)
        (self.path / "cgroup.procs").write_text(str(pid))
        try:
            yield
        finally:
            (home / "cgroup.procs").write_text(str(pid))

    @staticmethod
    def group_of(controller: Controller, pid: int) -> Path:
        """The folder of the group ``pid`` is in under ``controller`` (/proc/PID/cgroup: "0::/a" in v2,
        "3:cpu,cpuacct:/a" in v1)."""
        for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
            _, names, where = line.split(":", 2)
            if (controller.version == 2 and names == "") or "cpu" in names.split(","):
                return controller.root / where.lstrip("/")
        return controller.root

    def prefix(self) -> list[str]:
        """What to put before a command to run it (and all it starts) in the group."""
        return ["sh", "-c", f'echo $$ > {shlex.quote(str(self.path / "cgroup.procs"))} && exec "$@"', "sh"]

    def stat(self) -> dict[str, int]:
        """The group's cpu.stat: nr_periods, nr_throttled, throttled time (v1 in ns, v2 in us), ..."""
        pairs = (line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return {key: int(value) for key, value in pairs}

    def remove(self) -> None:
        """Move whatever still runs in the group to the root group, then remove the group (absent is fine)."""
        if not self.path.is_dir():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.controller.root / "cgroup.procs").write_text(pid)
            except OSError:  # it ended meanwhile
                pass
        self.path.rmdir()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="see the module docstring")
    p.add_argument("--cores", type=float, required=True, help="the share of one core: 0.5, 1, 1.5")
    p.add_argument("--period-ms", type=float, default=PERIOD_US / 1000, help="the quota's period (default %(default)g)")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1 :]
    if not command:
        p.error("give a COMMAND after --")
    why = unavailable()
    if why:
        print(f"cpu_quota: {why}", file=sys.stderr)
        return 1
    try:
        with CpuQuota(args.cores, period_us=round(args.period_ms * 1000)) as q:
            code = subprocess.call([*q.prefix(), *command])
            stat = q.stat()
    except RuntimeError as e:
        print(f"cpu_quota: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cpu_quota: interrupted", file=sys.stderr)
        return 130
    print(f"cpu_quota: {args.cores:g} core(s), throttled in {stat['nr_throttled']} of {stat['nr_periods']} "
          "periods", file=sys.stderr)  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
