"""The router's replica choice during a plan-changing roll: a prefill is chosen only where a
ready decode runs its routing plan, since KV cannot be handed across plans."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.metrics import RouterMetrics
from pdd_sidecar.serve.openai.openai_request import ApiError, GenRequest
from pdd_sidecar.serve.router.replica_pool import Pool
from pdd_sidecar.serve.router.routing_policy import make_policy
from pdd_sidecar.serve.router.upstreams import Router, Trip, served_max_model_len

MODEL = SimpleNamespace(vocab_size=256, max_model_len=4096)


def _pool(role: str, plans: dict[str, str | None]) -> Pool:
    pool = Pool(role, list(plans), "")
    for url, plan in plans.items():
        pool.mark(url, True)
        if plan is not None:
            pool.plans[url] = plan
    return pool


def test_prefill_is_chosen_only_with_a_ready_decode_of_its_plan() -> None:
    prefill = _pool("prefill", {"p-old": "old", "p-new": "new"})
    decode = _pool("decode", {"d-old": "old", "d-new": "new"})
    decode.mark("d-new", False)  # the new plan's decode is still starting
    assert decode.ready_plans() == {"old"}
    assert {prefill.pick(plans=decode.ready_plans()) for _ in range(4)} == {"p-old"}
    decode.mark("d-new", True)
    assert {prefill.pick(plans=decode.ready_plans()) for _ in range(4)} == {"p-old", "p-new"}
    decode.mark("d-old", False)
    decode.mark("d-new", False)
    assert prefill.pick(plans=decode.ready_plans()) is None


def test_replicas_that_do_not_report_a_plan_exclude_nothing() -> None:
    prefill = _pool("prefill", {"p1": "a", "p2": None})
    decode = _pool("decode", {"d1": None})
    assert decode.ready_plans() is None
    assert {prefill.pick(plans=decode.ready_plans()) for _ in range(4)} == {"p1", "p2"}


def _router_with(decodes: list[str]) -> Any:
    router = Router.__new__(Router)
    router.settings = SimpleNamespace(request_timeout_s=10.0,  # type: ignore[assignment]
                                      ready_wait_s=5.0)
    router.prefill = _pool("prefill", {"p": "plan"})
    router.decode = _pool("decode", dict.fromkeys(decodes, "plan"))
    return router


def _request() -> GenRequest:
    return GenRequest(kind="completion", prompt_ids=[1, 2], max_tokens=4, sampling={},
                      stop=[], stop_token_ids=[], ignore_eos=False, stream=False,
                      include_usage=False)


def test_a_decode_that_drops_the_connection_or_drains_is_retried_on_another() -> None:
    """A draining decode answers 503 and then exits, resetting connections it never
    answered: neither took the request, so another decode of the plan gets it."""

    async def run() -> tuple[str | None, list[str]]:
        async def reset(request: web.Request) -> web.StreamResponse:
            assert request.transport is not None
            request.transport.abort()  # RST, as a process that exits
            return web.Response()

        async def draining(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "not ready: draining"}},
                                     status=503)

        async def serving(request: web.Request) -> web.Response:
            return web.Response(text='{"token": 7}\n', content_type="application/x-ndjson")

        servers, urls = [], []
        for handler in (reset, draining, serving):
            app = web.Application()
            app.router.add_post("/v1/decode", handler)
            server = TestServer(app)
            await server.start_server()
            servers.append(server)
            urls.append(str(server.make_url("")).rstrip("/"))
        router = _router_with(urls)
        tried: list[str] = []
        try:
            async with aiohttp.ClientSession() as session:
                router.session = session
                for _ in range(3):  # round robin: every order of the three
                    trip = Trip(prefill="p")
                    resp = await router._open_decode("r", [(0, 1)], {}, _request(), trip)
                    resp.release()
                    tried.append(str(trip.decode))
                    for u in urls:
                        router.decode.mark(u, True)
        finally:
            for server in servers:
                await server.close()
        return urls[2], tried

    serving_url, used = asyncio.run(run())
    assert used == [serving_url] * 3


def test_a_stale_probe_is_looked_at_again_before_a_503() -> None:
    """The last probe round saw no ready prefill (it timed out under load, say) although one
    serves now: the request probes once more and goes there instead of failing."""

    async def run() -> tuple[str, int]:
        readyz, probes = _counted_readyz()

        async def prefill(request: web.Request) -> web.Response:
            return web.json_response({"first_token": 3})

        server, url = await _serve([("GET", "/readyz", readyz), ("POST", "/v1/prefill", prefill)])
        decode_server, decode = await _serve([("GET", "/readyz", _ready_decode)])
        try:
            chosen, body = await _prefill_with({url: "not ready"}, decode, 5.0)
        finally:
            await server.close()
            await decode_server.close()
        assert body == {"first_token": 3}
        return chosen, probes[0]

    chosen, probes = asyncio.run(run())
    assert chosen.startswith("http://") and probes >= 1


def _free_port_url() -> str:
    """An address nothing listens on: a pod just deleted."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def _serve(routes: list[tuple[str, str, Any]]) -> tuple[TestServer, str]:
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    server = TestServer(app)
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


def _counted_readyz(ready_from: int = 1) -> tuple[Any, list[int]]:
    """A /readyz that counts its probes and answers ready from the `ready_from`-th on."""
    probes = [0]

    async def readyz(request: web.Request) -> web.Response:
        probes[0] += 1
        if probes[0] < ready_from:
            return web.json_response({"ready": False}, status=503)
        return web.json_response({"ready": True, "plan_digest": "plan"})

    return readyz, probes


async def _ready_decode(request: web.Request) -> web.Response:
    return web.json_response({"ready": True, "plan_digest": "plan"})


async def _prefill_with(prefills: dict[str, str], decode: str, wait_s: float,
                        ) -> tuple[str, dict[str, Any]]:
    """run_prefill over these prefills (url -> "ready" / "not ready") and one ready decode."""
    router = _router_with([])
    router.settings = SimpleNamespace(request_timeout_s=10.0, upstream_protocol="pdd",
                                      ready_wait_s=wait_s)
    router.prefill = _pool("prefill", dict.fromkeys(prefills, "plan"))
    for url, state in prefills.items():
        router.prefill.mark(url, state == "ready")
    router.decode = _pool("decode", {decode: "plan"})
    router.metrics = RouterMetrics()
    router._probing = None
    async with aiohttp.ClientSession() as session:
        router.session = router.probe_session = session
        return await router.run_prefill("r", {}, Trip())


def test_a_request_waits_for_the_replacement_when_the_only_ready_prefill_is_gone() -> None:
    """A roll deletes the surge prefill the router still counts ready while the replacement's
    first probe has not passed yet: the request probes until the replacement is ready and
    goes there, instead of failing."""

    async def run() -> tuple[str, str, int]:
        readyz, probes = _counted_readyz(ready_from=3)  # loading its model until then

        async def prefill(request: web.Request) -> web.Response:
            return web.json_response({"first_token": 3})

        replacement_server, replacement = await _serve(
            [("GET", "/readyz", readyz), ("POST", "/v1/prefill", prefill)])
        decode_server, decode = await _serve([("GET", "/readyz", _ready_decode)])
        try:
            chosen, body = await _prefill_with(
                {_free_port_url(): "ready", replacement: "not ready"}, decode, 20.0)
        finally:
            await replacement_server.close()
            await decode_server.close()
        assert body == {"first_token": 3}
        return chosen, replacement, probes[0]

    chosen, replacement, probes = asyncio.run(run())
    assert chosen == replacement and probes >= 3


def test_when_every_ready_prefill_refused_the_request_fails_without_waiting() -> None:
    """Waiting helps only while nothing is ready: a replica that answered 503 keeps answering
    it, so the client gets the 503 after one probe round, not after the wait."""

    async def run() -> tuple[int, int]:
        readyz, probes = _counted_readyz()

        async def prefill(request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)

        server, url = await _serve([("GET", "/readyz", readyz), ("POST", "/v1/prefill", prefill)])
        decode_server, decode = await _serve([("GET", "/readyz", _ready_decode)])
        try:
            await _prefill_with({url: "ready"}, decode, 600.0)
        except ApiError as exc:
            return exc.status, probes[0]
        finally:
            await server.close()
            await decode_server.close()
        raise AssertionError("a prefill that answers 503 served the request")

    status, probes = asyncio.run(run())
    assert status == 503 and probes == 1


def test_the_probe_reads_each_replicas_load() -> None:
    """The instances' /readyz `load` is what the policy weighs besides the router's own count
    of requests in flight; a replica that does not report it (vLLM's /health) weighs by that
    count alone."""

    async def run() -> tuple[Any, Any]:
        async def loaded(request: web.Request) -> web.Response:
            return web.json_response({"ready": True, "plan_digest": "plan", "load": {
                "running": 3, "waiting": 2, "free_blocks": 40, "num_blocks": 100}})

        server, url = await _serve([("GET", "/readyz", loaded)])
        quiet_server, quiet = await _serve([("GET", "/readyz", _ready_decode)])
        settings = RouterSettings.from_env({"PDD_PREFILL_URLS": url,
                                            "PDD_DECODE_URLS": quiet})
        router = Router(settings, MODEL)  # type: ignore[arg-type]
        router.warm.done = True
        try:
            async with aiohttp.ClientSession() as session:
                router.probe_session = session
                await router.refresh()
        finally:
            await server.close()
            await quiet_server.close()
        return router.prefill.load.get(url), router.decode.load.get(quiet)

    prefill, decode = asyncio.run(run())
    assert prefill is not None and (prefill.running, prefill.waiting, prefill.free_blocks,
                                     prefill.num_blocks) == (3, 2, 40, 100)
    assert prefill.busy == 5 and decode is None


def test_readiness_checks_do_not_move_the_round_robin_turn() -> None:
    """/readyz asks whether a request could be routed; asking must not choose a replica, or
    probes between requests would decide which replica round robin gives the next one."""
    router = Router.__new__(Router)
    router.prefill = Pool("prefill", ["p1", "p2"], "", make_policy("round-robin", 16))
    router.decode = _pool("decode", {"d": None})
    for url in ("p1", "p2"):
        router.prefill.mark(url, True)
    chosen = []
    for _ in range(6):
        assert router.pools_ready  # a probe between two requests
        chosen.append(router.prefill.pick(plans=router.decode.ready_plans()))
    assert chosen == ["p1", "p2"] * 3
    router.prefill.mark("p1", False)
    router.prefill.mark("p2", False)
    assert not router.pools_ready


def test_a_burst_s_first_tokens_go_out_before_its_decode_streams_open() -> None:
    """Prefill answers that arrive together are relayed to their clients before any of them
    opens its decode stream: opening one costs the router's loop as much as a relay, and the
    TTFT of the 64th request in a burst would otherwise carry 63 of them."""
    # Every request through the prefill (short prompts would otherwise go to the decode).
    settings = RouterSettings.from_env({"PDD_PREFILL_URLS": "http://p:1",
                                        "PDD_DECODE_URLS": "http://d:1",
                                        "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "0"})
    router = Router(settings, MODEL)  # type: ignore[arg-type]
    router.prefill.mark("http://p:1", True)
    router.decode.mark("http://d:1", True)
    events: list[str] = []

    async def run() -> None:
        answered = asyncio.Event()

        async def run_prefill(rid: str, body: dict[str, Any], trip: Trip,
                              skip: Any = None, wait: bool = True
                              ) -> tuple[str, dict[str, Any]]:
            await answered.wait()  # every answer arrives in the same loop turn
            return "http://p:1", {"first_token": 7, "kv_transfer_params": {"pdd_grant": {}}}

        async def open_decode(rid: str, *args: Any) -> Any:
            events.append(f"open {rid}")
            raise ApiError(400, "stop here")

        router.run_prefill = run_prefill  # type: ignore[method-assign]
        router._open_decode = open_decode  # type: ignore[method-assign]
        router.release_soon = lambda *a, **k: None  # type: ignore[method-assign]

        async def stream(rid: str) -> None:
            req = GenRequest("completion", [1, 2, 3], 4, {}, [], [], True, True, False)
            try:
                async for _, batch in router.tokens(rid, req, Trip()):
                    events.append(f"token {rid} {batch}")
            except ApiError:
                pass

        tasks = [asyncio.create_task(stream(rid)) for rid in ("a", "b", "c")]
        await asyncio.sleep(0)
        answered.set()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert events == ["token a [7]", "token b [7]", "token c [7]", "open a", "open b", "open c"]


def test_served_max_model_len_is_the_least_of_the_model_and_what_each_role_holds() -> None:
    """A prefill holds the prompt (at most one token less than the whole), a decode all but the
    last generated token: each serves one token more than the KV it holds."""
    assert served_max_model_len(4096, None, None) == 4096
    assert served_max_model_len(4096, 1000, None) == 1001
    assert served_max_model_len(4096, None, 511) == 512
    assert served_max_model_len(4096, 1000, 511) == 512
    assert served_max_model_len(300, 1000, 2000) == 300


def test_models_reports_the_length_the_ready_instances_hold() -> None:
    """Through a probe round: the largest ready replica of each role counts, a replica not
    ready does not, and one that says nothing leaves the model's own limit."""

    def readyz(capacity: int | None, ready: bool = True) -> Any:
        async def handler(request: web.Request) -> web.Response:
            body: dict[str, Any] = {"ready": ready, "plan_digest": "plan"}
            if capacity is not None:
                body["kv_capacity_tokens"] = capacity
            return web.json_response(body, status=200 if ready else 503)
        return handler

    async def run(prefills: list[Any], decodes: list[Any]) -> int:
        servers, urls = [], {"prefill": [], "decode": []}
        for role, handlers in (("prefill", prefills), ("decode", decodes)):
            for h in handlers:
                server, url = await _serve([("GET", "/readyz", h)])
                servers.append(server)
                urls[role].append(url)
        settings = RouterSettings.from_env({"PDD_PREFILL_URLS": ",".join(urls["prefill"]),
                                            "PDD_DECODE_URLS": ",".join(urls["decode"])})
        router = Router(settings, MODEL)  # type: ignore[arg-type]
        router.warm.done = True
        try:
            async with aiohttp.ClientSession() as session:
                router.probe_session = session
                await router.refresh()
        finally:
            for server in servers:
                await server.close()
        return router.max_model_len()

    assert asyncio.run(run([readyz(2048), readyz(1024)], [readyz(8192)])) == 2049
    assert asyncio.run(run([readyz(9000)], [readyz(700), readyz(99999, ready=False)])) == 701
    assert asyncio.run(run([readyz(None)], [readyz(100000)])) == 4096


def test_a_lost_handoff_of_several_choices_feeds_the_decode_the_first_tokens_sent() -> None:
    """n = 3: the first prefill's choices reached the client; its KV could not be read, so the
    prompt runs again on the other prefill, whose own first tokens are not used: the decode is
    fed the ones the client has, those a stop id ended left out."""
    settings = RouterSettings.from_env({"PDD_PREFILL_URLS": "http://p:1,http://p:2",
                                        "PDD_DECODE_URLS": "http://d:1"})
    router = Router(settings, MODEL)  # type: ignore[arg-type]
    for url in ("http://p:1", "http://p:2"):
        router.prefill.mark(url, True)
    router.decode.mark("http://d:1", True)
    prefills: list[dict[str, Any]] = []
    opened: list[list[tuple[int, int]]] = []

    async def run_prefill(rid: str, body: dict[str, Any], trip: Trip,
                          skip: Any = None, wait: bool = True) -> tuple[str, dict[str, Any]]:
        prefills.append(body)
        url = "http://p:1" if not skip else "http://p:2"
        firsts = [7, 9, 8] if len(prefills) == 1 else [1, 2, 3]
        return url, {"first_token": firsts[0], "first_tokens": firsts,
                     "kv_transfer_params": {"pdd_grant": {}}}

    async def open_decode(rid: str, choices: list[tuple[int, int]], *args: Any) -> Any:
        opened.append(choices)
        if len(opened) == 1:
            raise ApiError(502, "READ failed", type_="transfer")
        raise ApiError(400, "stop here")

    router.run_prefill = run_prefill  # type: ignore[method-assign]
    router._open_decode = open_decode  # type: ignore[method-assign]
    router.release_soon = lambda *a, **k: None  # type: ignore[method-assign]
    req = GenRequest("completion", [1, 2, 3], 4, {"seed": 1}, [], [9], False, True, False,
                     local_stop_ids=frozenset({9}), n=3)
    got: list[tuple[int, list[int]]] = []

    async def stream() -> None:
        try:
            async for choice, batch in router.tokens("r", req, Trip()):
                got.append((choice, batch))
        except ApiError as exc:
            assert exc.status == 400

    asyncio.run(stream())
    assert got == [(0, [7]), (1, [9]), (2, [8])]  # each choice's first token, once
    assert [p.get("n") for p in prefills] == [3, 3]
    assert prefills[1]["ignore_eos"] is True and prefills[1]["stop_token_ids"] == []
    assert opened == [[(0, 7), (2, 8)], [(0, 7), (2, 8)]]
