"""The runtime fixtures leave nothing behind: the instances and routers forked for a test end
when the test run is killed outright, which no fixture teardown sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from polling import wait_for

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
        # its second rank forked: a grandchild of the run
        wait_for("the prefill's second rank", lambda: len(_tree(prefill)) >= 2, 60, 0.1)
        forked = [p for f in forked for p in _tree(f)]
        assert len(forked) >= 3 and os.getpgid(prefill) == prefill, forked
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        wait_for("every forked process to end with the killed test run",
                 lambda: not [p for p in forked if alive(p)], 30, 0.1)
    finally:
        run.kill()
        for p in forked:
            if alive(p):
                os.kill(p, signal.SIGKILL)
