"""The router supervisor's pure parts: what each worker is told, and a refusal that names
what it needs when it cannot make its workers' metrics folder."""

from __future__ import annotations

import tempfile

import pytest

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve import router_workers as rw


def test_each_worker_gets_its_index_and_the_shared_metrics_folder() -> None:
    env = rw.worker_env({"PDD_HTTP_PORT": "8000"}, 3, "/tmp/m")
    assert env == {"PDD_HTTP_PORT": "8000", "PDD_ROUTER_WORKER": "3",
                   "PROMETHEUS_MULTIPROC_DIR": "/tmp/m"}
    settings = RouterSettings.from_env({**env, "PDD_ROUTER_WORKERS": "4",
                                        "PDD_PREFILL_URLS": "http://p:1",
                                        "PDD_DECODE_URLS": "http://d:2"})
    assert (settings.workers, settings.worker) == (4, 3)


def test_no_writable_temp_folder_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/pdd-test")
    settings = RouterSettings.from_env({"PDD_ROUTER_WORKERS": "2",
                                        "PDD_PREFILL_URLS": "http://p:1",
                                        "PDD_DECODE_URLS": "http://d:2"})
    assert rw.run_workers(settings) == 2
    err = capsys.readouterr().err
    assert "PDD_ROUTER_WORKERS=2 needs a writable temporary folder (TMPDIR)" in err, err
