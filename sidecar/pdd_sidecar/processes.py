"""Linux process facts and ties the launchers, benchmarks and tests share: a child that dies
with its parent, and a process's state and children as /proc tells them."""

from __future__ import annotations

import ctypes
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


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(proc_stat(entry.name)[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not waited for, is not)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False
