"""The operator's API client turns any non-JSON answer into an error naming status, method and
path (the API server answers `404 page not found` in plain text for a group it does not serve;
proxies answer HTML), never a JSONDecodeError."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from pdd_operator.kube import ApiError, Kube


async def _serve(status: int, text: str, content_type: str) -> tuple[web.AppRunner, int]:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(status=status, text=text, content_type=content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    return runner, server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def _call(status: int, text: str, content_type: str, method: str, path: str) -> Exception:
    runner, port = await _serve(status, text, content_type)
    kube = Kube(f"http://127.0.0.1:{port}", False)
    try:
        await kube.request(method, path, body={} if method != "GET" else None, retries=0)
    except Exception as exc:  # noqa: BLE001 - the subject
        return exc
    finally:
        await kube.close()
        await runner.cleanup()
    raise AssertionError("no error raised")


@pytest.mark.parametrize(("status", "text", "ctype", "method", "path"), [
    (404, "404 page not found\n", "text/plain", "PATCH",
     "/apis/kopf.dev/v1/namespaces/x/kopfpeerings/pdd-operator"),
    (200, "<html>login</html>", "text/html", "GET", "/api/v1/namespaces/x/pods"),
    (403, "<html>Forbidden</html>", "text/html", "POST", "/api/v1/namespaces/x/pods"),
])
def test_non_json_answer_is_an_api_error_naming_status_method_path(
        status: int, text: str, ctype: str, method: str, path: str) -> None:
    exc = asyncio.run(_call(status, text, ctype, method, path))
    assert isinstance(exc, ApiError), repr(exc)
    assert exc.status == status
    message = str(exc)
    assert f"HTTP {status} {method} {path}" in message, message
    assert "non-JSON" in message and text.split()[0] in message, message


def test_json_error_keeps_the_api_message() -> None:
    body = '{"kind":"Status","reason":"Forbidden","message":"exceeded quota: q"}'
    exc = asyncio.run(_call(403, body, "application/json", "POST", "/api/v1/namespaces/x/pods"))
    assert isinstance(exc, ApiError)
    assert exc.reason == "Forbidden"
    assert str(exc) == "HTTP 403 POST /api/v1/namespaces/x/pods: exceeded quota: q"
