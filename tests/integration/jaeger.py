"""Jaeger v1.75.0 (`make jaeger`, tests/cluster/jaeger/) as a local process for the trace tests:
OTLP in over gRPC and HTTP, spans kept in memory, read back through its query API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_fixtures import free_port
from polling import wait_for

REPO = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("PDD_CLUSTER_BIN", REPO / ".cache" / "cluster" / "bin")) / "jaeger"
CONFIG = REPO / "tests" / "cluster" / "jaeger" / "config.yaml"


class Jaeger:
    def __init__(self, log_dir: Path) -> None:
        self.ports = {name: free_port() for name in (
            "PDD_JAEGER_OTLP_GRPC_PORT", "PDD_JAEGER_OTLP_HTTP_PORT", "PDD_JAEGER_QUERY_PORT",
            "PDD_JAEGER_QUERY_GRPC_PORT")}
        self.otlp_grpc = f"http://127.0.0.1:{self.ports['PDD_JAEGER_OTLP_GRPC_PORT']}"
        self.otlp_http = f"http://127.0.0.1:{self.ports['PDD_JAEGER_OTLP_HTTP_PORT']}"
        self.query = f"http://127.0.0.1:{self.ports['PDD_JAEGER_QUERY_PORT']}"
        self.log_path = log_dir / "jaeger.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Jaeger:
        if not BINARY.exists():
            pytest.fail(f"{BINARY} is missing: `make jaeger` builds it (make test-integration "
                        "does)", pytrace=False)
        env = {**os.environ, **{k: str(v) for k, v in self.ports.items()}}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(BINARY), "--config", str(CONFIG)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_for("Jaeger's query API", self._up, timeout=60)
        return self

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"jaeger exited {self.proc.returncode}:\n{self.log()}")
        try:
            self.get("/api/services")
            return True
        except (urllib.error.URLError, ConnectionError):
            return False

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.query}{path}", timeout=5) as r:
            return json.loads(r.read())

    def trace(self, trace_id: str) -> dict[str, Any] | None:
        """The trace as the query API gives it (spans, processes), None while it has none."""
        try:
            data = self.get(f"/api/traces/{trace_id}")["data"]
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return data[0] if data else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() \
            else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    j = Jaeger(tmp_path_factory.mktemp("jaeger")).start()
    yield j
    j.stop()
