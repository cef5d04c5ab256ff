"""A router of several processes on one port (`PDD_ROUTER_WORKERS`).

One router is one event loop: under hundreds of streams its per-token and per-request Python
is what a request waits for (docs/serving.md), and it uses one core of a host that has many.
With N workers, this process starts N whole routers that each bind the port with
SO_REUSEPORT (the kernel spreads connections over them), and only supervises: it forwards
SIGTERM/SIGINT, and when a worker dies on its own it stops the others and exits with that
worker's status, so that whatever runs the router (a Deployment, `pdd serve`) sees it fail
rather than serve with part of its workers. Workers die with it (PR_SET_PDEATHSIG).

What each worker holds is its own: its probes of the replicas, its warm round trip, its routing
policy's view (in-flight counts, the prefix index: cache-aware routing sees the requests of its
own connections), its `max_concurrency`. Metrics are summed over the workers
(pdd_sidecar/metrics.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from pdd_sidecar.env import PDD_ROUTER_WORKER, PDD_ROUTER_WORKERS_DIR, RouterSettings
from pdd_sidecar.metrics import MULTIPROC_DIR
from pdd_sidecar.processes import die_with_parent

log = logging.getLogger(__name__)

STOP_GRACE_S = 65.0  # a worker's own graceful stop: aiohttp's 60 s shutdown timeout


def worker_env(base: Mapping[str, str], index: int, shared_dir: str) -> dict[str, str]:
    return {**base, PDD_ROUTER_WORKER: str(index), PDD_ROUTER_WORKERS_DIR: shared_dir,
            MULTIPROC_DIR: shared_dir}


WARM_MARK = "warm-{}"  # beside the metrics' *.db files, which are all their collector reads


def mark_warm(shared_dir: str, index: int) -> None:
    """This worker's warm round trip came back."""
    (Path(shared_dir) / WARM_MARK.format(index)).touch()


def warm_workers(shared_dir: str, workers: int) -> int:
    """How many of the workers have run their warm round trip: the router is ready (and
    `pdd serve` says so) only once all have, whichever worker a probe reaches."""
    return sum((Path(shared_dir) / WARM_MARK.format(i)).exists() for i in range(workers))


def run_workers(settings: RouterSettings) -> int:
    try:
        metrics_dir = tempfile.mkdtemp(prefix="pdd-router-metrics-")
    except OSError as exc:
        print(f"pdd-router: refusing to start: PDD_ROUTER_WORKERS={settings.workers} needs a "
              f"writable temporary folder (TMPDIR) for its workers' metrics: {exc}",
              file=sys.stderr, flush=True)
        return 2
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(settings.workers):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "pdd_sidecar", "router"],
                env=worker_env(os.environ, i, metrics_dir), preexec_fn=die_with_parent))
        log.info("router: %d workers on port %d (pids %s)", len(workers), settings.port,
                 ", ".join(str(w.pid) for w in workers))
        status = _watch(workers, stopping)
    finally:
        _stop_all(workers)
        for s, handler in old.items():
            signal.signal(s, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


def _watch(workers: list[subprocess.Popen[bytes]], stopping: list[int]) -> int:
    """Until a signal asks to stop (0), or a worker exits on its own (its status, 1 at least:
    a router that lost a worker is not the router it was started as)."""
    while not stopping:
        for i, w in enumerate(workers):
            rc = w.poll()
            if rc is not None:
                log.error("router worker %d (pid %d) exited with status %d; stopping the "
                          "others", i, w.pid, rc)
                return rc or 1
        time.sleep(0.1)
    return 0


def _stop_all(workers: list[subprocess.Popen[bytes]]) -> None:
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for w in workers:
        try:
            w.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
