"""The operator's LISTs come in pages, each page's items passed through `keep` (the store's
`lean`) before the next page is asked for, so a LIST of every pod of hundreds of PDDeployments
is never held parsed at once (it was the operator's peak memory). An expired continue token
(410) starts the list over."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pdd_operator import kube as kube_mod
from pdd_operator.kube import Kube

PODS = 250


class FakeApi:
    def __init__(self, expire_once: bool = False) -> None:
        self.asked: list[dict[str, str]] = []
        self.kept_when_asked: list[int] = []
        self.kept = 0
        self.expire_once = expire_once

    async def handle(self, request: web.Request) -> web.Response:
        q = dict(request.query)
        self.asked.append(q)
        self.kept_when_asked.append(self.kept)
        token = q.get("continue", "")
        if token and self.expire_once:
            self.expire_once = False
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired",
                                      "message": "continue parameter is too old"}, status=410)
        start = int(token or 0)
        limit = int(q.get("limit", PODS))
        end = min(PODS, start + limit)
        items = [{"metadata": {"name": f"p{i}", "namespace": "ns",
                               "managedFields": [{"manager": "x"}]}} for i in range(start, end)]
        meta: dict[str, Any] = {"resourceVersion": "77"}
        if end < PODS:
            meta["continue"] = str(end)
        return web.json_response({"kind": "PodList", "metadata": meta, "items": items})


async def _list(api: FakeApi) -> tuple[list[dict[str, Any]], str | None]:
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods", api.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    kube = Kube(f"http://127.0.0.1:{port}", False)

    def keep(obj: dict[str, Any]) -> dict[str, Any]:
        api.kept += 1
        return {"kind": obj["kind"], "metadata": {"name": obj["metadata"]["name"]}}

    try:
        return await kube.list_rv("Pod", "ns", "app=x", keep=keep)
    finally:
        await kube.close()
        await runner.cleanup()


def test_a_list_is_read_in_pages_each_kept_before_the_next() -> None:
    api = FakeApi()
    items, rv = asyncio.run(_list(api))
    assert rv == "77"
    assert [o["metadata"]["name"] for o in items] == [f"p{i}" for i in range(PODS)]
    assert all(o["kind"] == "Pod" and "managedFields" not in o["metadata"] for o in items)
    page = kube_mod.LIST_PAGE
    assert PODS > 2 * page  # three pages at least
    assert len(api.asked) == -(-PODS // page)
    assert all(q["limit"] == str(page) and q["labelSelector"] == "app=x" for q in api.asked)
    # every page's items went through keep before the next page was asked for
    assert api.kept_when_asked == [i * page for i in range(len(api.asked))]


def test_an_expired_continue_token_starts_the_list_over() -> None:
    api = FakeApi(expire_once=True)
    items, rv = asyncio.run(_list(api))
    assert [o["metadata"]["name"] for o in items] == [f"p{i}" for i in range(PODS)]
    assert "continue" not in api.asked[2]  # the 410 answered asked[1]; asked[2] starts over
    assert rv == "77"


def test_a_leaned_page_is_stored_as_it_is_not_leaned_again() -> None:
    """The pages come leaned (`keep=lean`); the store keeps those objects without walking
    them a second time."""
    from pdd_operator.store import Store, lean

    pod = {"kind": "Pod", "metadata": {"name": "p0", "namespace": "ns", "uid": "u",
                                       "resourceVersion": "1", "managedFields": [{}]}}
    kept = lean(pod)
    assert lean(kept) is kept and "managedFields" not in kept["metadata"]
    store = Store()
    store.upsert("Pod", kept)
    assert store.get("Pod", "ns", "p0") is kept
