"""Linux process facts and ties the launchers, benchmarks and tests share: a child that dies
with its parent, and a process's state and children as /proc tells them."""

from __future__ import annotations

import ctypes
import math
import os
import signal
from pathlib import Path


def die_with_parent() -> None:
    """A child gets SIGTERM when its parent dies, even killed outright (Linux; best effort)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def proc_stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first, then the parent's pid...);
    OSError once the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parents() -> dict[int, list[int]]:
    """Every process's children now, by parent pid (one pass over /proc)."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out.setdefault(int(proc_stat(entry.name)[1]), []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now."""
    return parents().get(pid, [])


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not waited for, is not)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False


def quota_cpus(cpu_max: str | None = None, cfs_quota_us: str | None = None,
               cfs_period_us: str | None = None) -> int | None:
    """The CPUs a cgroup's quota allows, rounded up, from cgroup v2's ``cpu.max`` ("max 100000"
    or "200000 100000") or v1's ``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``;
    None when there is no quota or the text is not one."""
    try:
        if cpu_max is not None:
            quota, period = cpu_max.split()[:2]
            if quota == "max":
                return None
            q, p = int(quota), int(period)
        elif cfs_quota_us is not None and cfs_period_us is not None:
            q, p = int(cfs_quota_us), int(cfs_period_us)
        else:
            return None
    except ValueError:
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by its cgroup's CPU quota (a
    container's CPU limit, which ``os.cpu_count()`` does not see)."""
    cpus = len(os.sched_getaffinity(0))
    quota = quota_cpus(_read("/sys/fs/cgroup/cpu.max")) or quota_cpus(
        None, _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    return min(cpus, quota) if quota else cpus


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far: schedstat's nanoseconds where the kernel
    keeps them, else stat's clock ticks; 0.0 once it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return sum(int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
                   for t in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = proc_stat(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and of every live process below it."""
    below = parents()
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu_seconds(p)
        todo += below.get(p, [])
    return total
