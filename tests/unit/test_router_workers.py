"""The router supervisor's pure parts: what each worker is told, and a refusal that names
what it needs when it cannot make its workers' metrics folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.router import router_workers as rw


def test_each_worker_gets_its_index_and_the_shared_metrics_folder() -> None:
    env = rw.worker_env({"PDD_HTTP_PORT": "8000"}, 3, "/tmp/m")
    assert env == {"PDD_HTTP_PORT": "8000", "PDD_ROUTER_WORKER": "3",
                   "PDD_ROUTER_WORKERS_DIR": "/tmp/m", "PROMETHEUS_MULTIPROC_DIR": "/tmp/m"}
    settings = RouterSettings.from_env({**env, "PDD_ROUTER_WORKERS": "4",
                                        "PDD_PREFILL_URLS": "http://p:1",
                                        "PDD_DECODE_URLS": "http://d:2"})
    assert (settings.workers, settings.worker, settings.workers_dir) == (4, 3, "/tmp/m")


def test_the_router_is_warm_once_every_worker_is(tmp_path: Path) -> None:
    """Each worker marks its warm round trip in the shared folder; readiness counts them all,
    whichever worker a probe reaches."""
    from pdd_sidecar.serve.openai.text import load_model_text
    from pdd_sidecar.serve.router.upstreams import Router

    shared = str(tmp_path)
    env = {"PDD_ROUTER_WORKERS": "2", "PDD_PREFILL_URLS": "http://p:1",
           "PDD_DECODE_URLS": "http://d:2", "PDD_ROUTER_WORKERS_DIR": shared}
    model = load_model_text("builtin", None)
    first, second = (Router(RouterSettings.from_env({**env, "PDD_ROUTER_WORKER": str(i)}),
                            model) for i in range(2))
    assert rw.warm_workers(shared, 2) == 0 and first.workers_warm == 0
    first._warmed(0.5)
    assert first.workers_warm == second.workers_warm == rw.warm_workers(shared, 2) == 1
    second._warmed(0.7)
    assert first.workers_warm == second.workers_warm == 2
    alone = Router(RouterSettings.from_env({k: v for k, v in env.items()
                                            if k != "PDD_ROUTER_WORKERS_DIR"}
                                           | {"PDD_ROUTER_WORKERS": "1"}), model)
    assert alone.workers_warm == 0
    alone.warm.done = True
    assert alone.workers_warm == 1


def test_no_writable_temp_folder_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/pdd-test")
    settings = RouterSettings.from_env({"PDD_ROUTER_WORKERS": "2",
                                        "PDD_PREFILL_URLS": "http://p:1",
                                        "PDD_DECODE_URLS": "http://d:2"})
    assert rw.run_workers(settings) == 2
    err = capsys.readouterr().err
    assert "PDD_ROUTER_WORKERS=2 needs a writable temporary folder (TMPDIR)" in err, err
