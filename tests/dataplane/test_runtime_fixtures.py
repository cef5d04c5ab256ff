"""The runtime fixtures leave nothing behind: the instances and routers forked for a test end
when the test run is killed outright, which no fixture teardown sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdd_sidecar.processes import alive, children

pytestmark = pytest.mark.dataplane

HERE = Path(__file__).resolve().parent
SIDECAR = HERE.parents[1] / "sidecar"

RUN = """
import sys, time
from pathlib import Path
from runtime_fixtures import LocalCluster, plan_json

if __name__ == "__main__":
    cluster = LocalCluster(Path(sys.argv[1]))
    routing = cluster.plan_file(plan_json((2, 1), (1, 1), 16))
    prefill = cluster.instance("prefill", 2, 1, routing, 16)
    router = cluster.router([prefill], [])
    print(prefill.process.pid, router.process.pid, flush=True)
    time.sleep(300)
"""


def _tree(pid: int) -> list[int]:
    return [pid, *(p for c in children(pid) for p in _tree(c))]


def test_instances_and_routers_end_when_the_test_run_is_killed_outright(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(SIDECAR)])}
    run = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                           text=True, env=env)
    forked: list[int] = []
    try:
        assert run.stdout is not None
        forked = [int(p) for p in run.stdout.readline().split()]
        prefill = forked[0]
        deadline = time.monotonic() + 60
        while len(_tree(prefill)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # its second rank forked: a grandchild of the run
        forked = [p for f in forked for p in _tree(f)]
        assert len(forked) >= 3 and all(os.getpgid(p) == p for p in forked[:1]), forked
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in forked) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in forked if alive(p)], "outlived the killed test run"
    finally:
        run.kill()
        for p in forked:
            if alive(p):
                os.kill(p, signal.SIGKILL)
