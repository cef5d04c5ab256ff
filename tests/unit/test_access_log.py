"""serve/access_log.py: error bodies are logged with the request's trace id whatever the
setting, every request with PDD_ACCESS_LOG=1, probes never."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdd_sidecar.serve import access_log

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"}


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def refused(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "no ready decode replica", "code": 503}},
                             status=503)


async def traced(request: web.Request) -> web.Response:
    request[access_log.TRACE_ID] = "f" * 32  # what the router's request span recorded
    return web.json_response({"error": {"message": "max_tokens: too many"}}, status=400)


def run(access: bool, calls: list[tuple[str, str, dict[str, str]]]) -> None:
    async def go() -> None:
        app = web.Application(middlewares=[access_log.middleware(access)])
        for path, handler in (("/ok", ok), ("/refused", refused), ("/traced", traced),
                              ("/healthz", refused)):
            app.router.add_route("*", path, handler)
        async with TestClient(TestServer(app)) as client:
            for method, path, headers in calls:
                await (await client.request(method, path, headers=headers)).read()

    asyncio.run(go())


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdd.access"]


def test_error_bodies_are_logged_with_the_trace_id(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdd.access")
    run(False, [("POST", "/ok", PARENT), ("POST", "/refused", PARENT), ("POST", "/traced", {}),
                ("GET", "/healthz", {}), ("POST", "/refused", {})])
    got = lines(caplog)
    assert [(lvl, m.split(" ", 3)[:3]) for lvl, m in got] == [
        (logging.WARNING, ["POST", "/refused", "503"]), (logging.INFO, ["POST", "/traced", "400"]),
        (logging.WARNING, ["POST", "/refused", "503"])]
    assert got[0][1].endswith(f"trace_id={TRACE} error: no ready decode replica")
    assert got[1][1].endswith(f"trace_id={'f' * 32} error: max_tokens: too many")
    assert "trace_id=- error" in got[2][1]


def test_access_log_names_every_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdd.access")
    run(True, [("POST", "/ok", PARENT), ("GET", "/healthz", PARENT)])
    ((level, message),) = lines(caplog)
    assert level == logging.INFO and message.startswith("POST /ok 200 ")
    assert message.endswith(f"trace_id={TRACE}")
    assert access_log.enabled({"PDD_ACCESS_LOG": "1"})
    assert not access_log.enabled({}) and not access_log.enabled({"PDD_ACCESS_LOG": "0"})
