"""The router's idle connections to an instance: opened before a burst, then reused by it."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdd_sidecar.serve.router.connection_warmer import ConnectionWarmer, due


def test_due_names_instances_not_topped_up_within_the_interval() -> None:
    last = {"a": 100.0, "b": 75.0}
    assert due(["a", "b", "c"], last, 110.0, interval_s=30.0) == ["b", "c"]
    assert due(["a"], last, 130.0, interval_s=30.0) == ["a"]


def test_warm_connections_are_what_a_burst_then_uses() -> None:
    async def run() -> tuple[int, int, int, int, bool]:
        peers: set[object] = set()

        async def any_path(request: web.Request) -> web.Response:
            peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
            await asyncio.sleep(0.01)  # the burst's requests overlap
            return web.json_response({"ready": True})

        app = web.Application()
        app.router.add_get("/readyz", any_path)
        app.router.add_post("/v1/prefill", any_path)
        server = TestServer(app)
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        try:
            async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(keepalive_timeout=60)) as session:
                warmer = ConnectionWarmer(8)
                answered = await warmer.warm(session, url)
                warmed = len(peers)
                await asyncio.gather(*(session.post(f"{url}/v1/prefill", json={})
                                       for _ in range(8)))
                after_burst = len(peers)
                warmer.ensure(session, [url])  # due: never topped up through ensure
                await asyncio.gather(*warmer._tasks)
                warmer.ensure(session, [url])  # not due again
                pending = len(warmer._tasks)
                warmer.ensure(session, [])  # not ready: forgotten, so due once ready again
                forgotten = url not in warmer.last
                await warmer.stop()
                return answered, warmed, after_burst, pending, forgotten
        finally:
            await server.close()

    answered, warmed, after_burst, pending, forgotten = asyncio.run(run())
    assert (answered, warmed) == (8, 8)
    assert after_burst == 8  # the burst opened no connection of its own
    assert pending == 0 and forgotten


def test_an_unreachable_instance_is_counted_not_raised() -> None:
    async def run() -> int:
        async with aiohttp.ClientSession() as session:
            return await ConnectionWarmer(3).warm(session, "http://127.0.0.1:9")

    assert asyncio.run(run()) == 0
