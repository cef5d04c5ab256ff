"""Process ties: a child started with die_with_parent ends when its parent is killed outright,
and /proc tells a process's children and whether it still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from polling import wait_for

from pdd_sidecar.processes import alive, children

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
