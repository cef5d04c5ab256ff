"""The operator's API client turns any non-JSON answer into an error naming status, method and
path (the API server answers `404 page not found` in plain text for a group it does not serve;
proxies answer HTML), never a JSONDecodeError."""

from __future__ import annotations

import asyncio
from typing import Any

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


class _Recording(Kube):
    """Answers every request from memory and records it."""

    def __init__(self) -> None:
        super().__init__("http://unused", False)
        self.calls: list[tuple[str, str, Any]] = []
        self.gone: set[str] = set()

    async def request(self, method: str, path: str, **kw: Any) -> Any:  # type: ignore[override]
        self.calls.append((method, path, kw.get("body")))
        if method == "PATCH" and path.rsplit("/", 1)[1] in self.gone:
            raise ApiError(404, {"message": "not found"}, method, path)
        return {}


def test_repeated_events_aggregate_per_object_and_reason() -> None:
    kube = _Recording()
    pdd = {"kind": "PDDeployment", "metadata": {"name": "a", "namespace": "ns", "uid": "u1"}}

    async def scenario() -> None:
        await kube.post_event(pdd, "Warning", "ReconcileFailed", "quota 1")
        await kube.post_event(pdd, "Warning", "ReconcileFailed", "quota 2")
        await kube.post_event(pdd, "Warning", "ReconcileFailed", "quota 3")
        await kube.post_event(pdd, "Normal", "Created", "Created Pod a-decode-0")
        await asyncio.gather(*(kube.post_event(pdd, "Normal", "Deleted", f"x{i}")
                               for i in range(5)))

    asyncio.run(scenario())
    posts = [c for c in kube.calls if c[0] == "POST"]
    patches = [c for c in kube.calls if c[0] == "PATCH"]
    assert [p[2]["reason"] for p in posts] == ["ReconcileFailed", "Created", "Deleted"]
    failed = posts[0][2]["metadata"]["name"]
    assert [(p[1].rsplit("/", 1)[1], p[2]["count"], p[2]["message"]) for p in patches[:2]] == [
        (failed, 2, "quota 2"), (failed, 3, "quota 3")]
    assert [p[2]["count"] for p in patches[2:]] == [2, 3, 4, 5], "concurrent repeats too"
    # an expired Event (404 on the patch) is posted again
    kube.gone.add(failed)
    asyncio.run(kube.post_event(pdd, "Warning", "ReconcileFailed", "quota 4"))
    assert kube.calls[-1][0] == "POST" and kube.calls[-1][2]["count"] == 1


def test_events_of_one_reason_keep_apart_by_series() -> None:
    kube = _Recording()
    pdd = {"kind": "PDDeployment", "metadata": {"name": "a", "namespace": "ns", "uid": "u1"}}

    async def scenario() -> None:
        await kube.post_event(pdd, "Normal", "ScaledUp", "decode 1->2", series="decode")
        await kube.post_event(pdd, "Normal", "ScaledUp", "prefill 1->2", series="prefill")
        await kube.post_event(pdd, "Normal", "ScaledUp", "decode 2->3", series="decode")

    asyncio.run(scenario())
    posts = [c for c in kube.calls if c[0] == "POST"]
    patches = [c for c in kube.calls if c[0] == "PATCH"]
    assert [p[2]["message"] for p in posts] == ["decode 1->2", "prefill 1->2"]
    assert [p[2]["message"] for p in patches] == ["decode 2->3"]
    assert patches[0][1].endswith(posts[0][2]["metadata"]["name"])
