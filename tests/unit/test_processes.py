"""Process ties: a child started with die_with_parent ends when its parent is killed outright,
and /proc tells a process's children and whether it still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from polling import wait_for

from pdd_sidecar.processes import (
    alive,
    children,
    cpu_seconds,
    quota_cpus,
    tree_cpu_seconds,
    usable_cpus,
)

PARENT = """
import subprocess, sys, time
from pdd_sidecar.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_dies_with_its_parent_killed_outright() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert children(parent.pid) == [child]
        assert alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert not alive(parent.pid)
        # Reparented and sent SIGTERM; whoever adopts it reaps it (or it stays a zombie,
        # which alive() counts as gone).
        wait_for("the child to end with its parent", lambda: not alive(child), 10, 0.05)
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_children_and_alive_follow_a_process() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert sleeper.pid in children(os.getpid())
        assert children(sleeper.pid) == []
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert not alive(sleeper.pid)


@pytest.mark.parametrize(("v2", "v1", "cpus"), [
    ("max 100000\n", None, None),
    ("200000 100000\n", None, 2),
    ("150000 100000", None, 2),
    ("50000 100000", None, 1),
    ("garbage", None, None),
    (None, ("-1\n", "100000\n"), None),
    (None, ("400000", "100000"), 4),
    (None, ("x", "100000"), None),
    (None, None, None),
])
def test_a_cgroup_quota_in_cpus(v2: str | None, v1: tuple[str, str] | None,
                                cpus: int | None) -> None:
    assert quota_cpus(v2, *(v1 or (None, None))) == cpus


def test_usable_cpus_are_at_most_the_affinity() -> None:
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


# Spins for 0.4 s of its own CPU time (not wall time: a loaded machine must not shorten it),
# then says so on the pipe it shares with its parent.
SPIN_THEN_SLEEP = "import time\\nwhile time.process_time() < 0.4: pass\\n" \
    "print('spun', flush=True)\\ntime.sleep(60)"
BUSY_CHILD = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "{SPIN_THEN_SLEEP}"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_cpu_seconds_count_a_process_and_those_below_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", BUSY_CHILD], stdout=subprocess.PIPE,
                              text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "spun"
        own, below = cpu_seconds(parent.pid), cpu_seconds(child)
        assert below >= 0.3
        assert tree_cpu_seconds(parent.pid) >= own + below - 0.01
        assert tree_cpu_seconds(parent.pid) < own + below + 0.2
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)
    assert cpu_seconds(parent.pid) == 0.0  # gone
