"""`PDD_ROUTER_WORKERS`: a router of several processes on one port serves every request, reports
metrics summed over its workers whichever answers, stops whole on SIGTERM, and exits (with
every worker gone) when one of its workers dies."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import wait_for
from runtime_fixtures import http

from pdd_sidecar.processes import alive, children
from pdd_sidecar.serve.local_stack import StackConfig, pick_ports, router_env

pytestmark = pytest.mark.dataplane

ROOT = Path(__file__).resolve().parents[2]
OK_COUNT = re.compile(r'^pdd_router_requests_total\{outcome="ok"\} ([0-9.e+]+)$', re.M)


@pytest.fixture
def stubs() -> Iterator[tuple[StackConfig, object]]:
    """Stub upstreams (bench/router_overhead.py's) answering at once."""
    # The stubs answer the prefill -> decode protocol: every request through it.
    cfg = StackConfig(port=0, log_level="WARNING", router_workers=2, local_prefill_tokens=0)
    ports = pick_ports(cfg)
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "router_overhead.py"),
                             "--stubs", str(ports.prefill[0].http), str(ports.decode[0].http),
                             "0"])
    try:
        yield cfg, ports
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def ready(url: str) -> bool:
    try:
        return http("GET", f"{url}/readyz", timeout=5)[0] == 200
    except OSError:
        return False


def start_router(cfg: StackConfig, ports: object) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sidecar"),
           **router_env(cfg, ports)}  # type: ignore[arg-type]
    proc = subprocess.Popen([sys.executable, "-m", "pdd_sidecar", "router"], env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{ports.router}"  # type: ignore[attr-defined]
    wait_for("the router to be ready", lambda: ready(url), 60, 0.05)
    return proc


def complete(url: str, prompt: list[int]) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(f"{url}/v1/completions", method="POST", data=json.dumps(
        {"prompt": prompt, "max_tokens": 3}).encode(),
        headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def test_workers_share_the_port_and_their_metrics(stubs: tuple[StackConfig, object]) -> None:
    cfg, ports = stubs
    router = start_router(cfg, ports)
    url = f"http://127.0.0.1:{ports.router}"  # type: ignore[attr-defined]
    try:
        workers = children(router.pid)
        assert len(workers) == 2, workers
        status, body = http("GET", f"{url}/readyz")  # ready: both workers' round trips ran
        assert status == 200 and body["workers_warm"] == "2/2", body
        answers = [complete(url, [1 + i % 50, 2, 3]) for i in range(24)]
        assert all(status == 200 for status, _ in answers), answers
        assert all(a["choices"][0]["token_ids"] == [1, 2, 3] for _, a in answers), answers[0]
        served = set()
        for _ in range(6):  # new connections: either worker answers, with the same sums
            status, text = http("GET", f"{url}/metrics")
            assert status == 200
            (count,) = OK_COUNT.findall(str(text))
            served.add(float(count))
        assert served == {24.0}, served
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=40) == 0
        wait_for("every worker to stop", lambda: not any(alive(w) for w in workers), 10, 0.05)
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait()


def test_a_worker_that_dies_takes_the_router_down(stubs: tuple[StackConfig, object]) -> None:
    cfg, ports = stubs
    router = start_router(cfg, ports)
    try:
        first, second = children(router.pid)
        os.kill(first, signal.SIGKILL)
        assert router.wait(timeout=40) != 0
        wait_for("the other worker to stop with the router", lambda: not alive(second), 10,
                 0.05)
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait()
