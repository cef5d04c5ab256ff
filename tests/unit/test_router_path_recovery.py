"""The per-request path when the replicas it counted on are not what the decision saw: a
short request goes only to a decode that caches it, a decode's prefix cache reuses whole units
only, a request whose prefill died falls back at once, a local request every decode refused
goes through a prefill, a retry passes over prefills that already failed it, and probe rounds
never overlap. The path metric counts where a request was taken, once, never the warm-up."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.openai.openai_request import ApiError, GenRequest
from pdd_sidecar.serve.router.prefill_path import FALLBACK, LOCAL, REMOTE
from pdd_sidecar.serve.router.upstreams import Router, Trip

from .test_router_pool import _free_port_url, _serve

MODEL = SimpleNamespace(vocab_size=256, max_model_len=8192, codec=None)


def _router(**env: str) -> Router:
    settings = RouterSettings.from_env({"PDD_BLOCK_SIZE": "16", **env})
    return Router(settings, MODEL)  # type: ignore[arg-type]


def _req(prompt: list[int], max_tokens: int = 4) -> GenRequest:
    return GenRequest("completion", prompt, max_tokens, {}, [], [], True, False, False)


def _paths(router: Router) -> dict[str, float]:
    return {p: router.metrics.paths.labels(path=p)._value.get()
            for p in (REMOTE, LOCAL, FALLBACK)}


def _answers(sent: list[str], name: str, body: dict[str, Any], status: int = 200) -> Any:
    """A replica's handler that notes it was called (``name``), then answers ``body``."""

    async def handler(request: web.Request) -> web.Response:
        sent.append(name)
        return web.json_response(body, status=status)

    return handler


def _decode_handler(seen: list[dict[str, Any]]) -> Any:
    """A decode that streams its tokens as pdd's do: one JSON line each, then the final line."""

    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        resp = web.StreamResponse()
        await resp.prepare(request)
        n = body["max_new_tokens"] + (1 if body.get("local_prefill") else 0)
        for i in range(n):
            await resp.write(json.dumps({"token": 10 + i}).encode() + b"\n")
        await resp.write(json.dumps({"finish_reason": "length", "cached_tokens": 0}).encode()
                         + b"\n")
        await resp.write_eof()
        return resp

    return decode


async def _with_sessions(router: Router) -> None:
    router.session = aiohttp.ClientSession()
    router.probe_session = aiohttp.ClientSession()
    router.warm.done = True


async def _close(router: Router, *servers: TestServer) -> None:
    assert router.session is not None and router.probe_session is not None
    await router.session.close()
    await router.probe_session.close()
    for server in servers:
        await server.close()


def test_a_short_request_goes_only_to_a_decode_that_caches_it() -> None:
    """The decision counted d1's cache (it served the conversation); d1 is busy and d2 idle, yet
    the request goes to d1: on d2 it would prefill the whole conversation in the batch."""
    router = _router(PDD_PREFILL_URLS="http://p:1", PDD_DECODE_URLS="http://d:1,http://d:2")
    router.prefill.mark("http://p:1", True)
    for url in ("http://d:1", "http://d:2"):
        router.decode.mark(url, True)
        router.decode.local_prefill.add(url)
    first = [1 + i % 200 for i in range(2000)]
    router.decode.served("http://d:1", first)
    router.decode.report("http://d:1", {"running": 20, "waiting": 0})
    router.decode.report("http://d:2", {"running": 0, "waiting": 0})
    req = _req(first + [5, 6, 7, 8])
    assert router.choose_path(req, Trip()) == LOCAL
    opened: list[str] = []

    async def open_on(url: str, *args: Any) -> Any:
        opened.append(url)
        raise ApiError(400, "stop here")

    router._open_decode_on = open_on  # type: ignore[method-assign]
    router.session = object()  # type: ignore[assignment]  # never used: open_on stands in
    try:
        asyncio.run(router.generate("a", req, Trip(), None))
    except ApiError:
        pass
    assert opened == ["http://d:1"]
    # a fresh prompt (cached nowhere) is short enough on either: the least loaded takes it
    opened.clear()
    try:
        asyncio.run(router.generate("b", _req([3] * 40), Trip(), None))
    except ApiError:
        pass
    assert opened == ["http://d:2"]


def test_the_estimate_counts_whole_units_of_the_decode_s_prefix_cache() -> None:
    """A decode with DCP 8 and blocks of 64 reuses 512 tokens at a time: after a 500-token first
    turn it caches none of the follow-up, which goes through the prefill."""
    router = _router(PDD_PREFILL_URLS="http://p:1", PDD_DECODE_URLS="http://d:1",
                     PDD_BLOCK_SIZE="64")
    router.prefill.mark("http://p:1", True)
    router.decode.mark("http://d:1", True)
    router.decode.local_prefill.add("http://d:1")
    first = [1 + i % 200 for i in range(500)]
    router.decode.served("http://d:1", first)
    req = _req(first + [7] * 200)
    # as the blocks go
    assert router.decode.cached_by(req.prompt_ids, ["http://d:1"])["http://d:1"] == 448
    assert router.choose_path(req, Trip()) == LOCAL
    router.decode.cache_unit["http://d:1"] = 512
    assert router.decode.cached_by(req.prompt_ids, ["http://d:1"])["http://d:1"] == 0
    assert router.choose_path(req, Trip()) == REMOTE


def test_the_probe_reads_the_decode_s_cache_unit() -> None:
    async def run() -> dict[str, int]:
        async def readyz(request: web.Request) -> web.Response:
            return web.json_response({"ready": True, "local_prefill": True,
                                      "cache_unit_tokens": 128})

        server, url = await _serve([("GET", "/readyz", readyz)])
        router = _router(PDD_PREFILL_URLS=_free_port_url(), PDD_DECODE_URLS=url)
        await _with_sessions(router)
        try:
            await router.refresh()
        finally:
            await _close(router, server)
        return router.decode.cache_unit

    assert list(asyncio.run(run()).values()) == [128]


def test_a_request_whose_prefill_died_falls_back_at_once() -> None:
    """The last probe saw the prefill ready; it is gone when the request reaches it. With the
    fallback on, the request is served on the decode without waiting for a prefill, and is
    counted once, as a fallback."""

    async def run() -> tuple[float, str | None, list[int], dict[str, float]]:
        seen: list[dict[str, Any]] = []
        server, decode = await _serve([("POST", "/v1/decode", _decode_handler(seen))])
        router = _router(PDD_PREFILL_URLS=_free_port_url(), PDD_DECODE_URLS=decode,
                         PDD_ROUTER_READY_WAIT_S="30")
        await _with_sessions(router)
        router.prefill.mark(router.prefill.urls[0], True)
        router.decode.mark(decode, True)
        router.decode.local_prefill.add(decode)
        router.probe_now = _no_probe  # type: ignore[method-assign]
        trip = Trip()
        t0 = time.monotonic()
        try:
            outs = await router.generate("a", _req(list(range(1, 600))), trip, None)
        finally:
            await _close(router, server)
        assert seen and seen[0].get("local_prefill") is True
        return time.monotonic() - t0, trip.path, outs[0].token_ids, _paths(router)

    took, path, tokens, paths = asyncio.run(run())
    assert took < 10, took  # not the 30 s ready wait
    assert path == FALLBACK and tokens == [10, 11, 12, 13]
    assert paths == {REMOTE: 0, LOCAL: 0, FALLBACK: 1}


def test_after_a_dead_prefill_the_fallback_takes_a_decode_of_any_plan() -> None:
    """A plan-changing roll: the prefill of plan X died, the decode that prefills prompts runs
    plan Y. The fallback is not held to the dead prefill's plan (nor does its answer name it)."""

    async def run() -> tuple[str | None, str | None, list[int]]:
        seen: list[dict[str, Any]] = []
        server, d_new = await _serve([("POST", "/v1/decode", _decode_handler(seen))])
        d_old, dead = "http://old:1", _free_port_url()
        router = _router(PDD_PREFILL_URLS=dead, PDD_DECODE_URLS=f"{d_old},{d_new}",
                         PDD_ROUTER_READY_WAIT_S="30")
        await _with_sessions(router)
        router.prefill.mark(dead, True)
        router.prefill.plans[dead] = "X"
        for url, plan in ((d_old, "X"), (d_new, "Y")):
            router.decode.mark(url, True)
            router.decode.plans[url] = plan
        router.decode.local_prefill.add(d_new)
        router.probe_now = _no_probe  # type: ignore[method-assign]
        trip = Trip()
        try:
            outs = await router.generate("a", _req(list(range(1, 600))), trip, None)
        finally:
            await _close(router, server)
        return trip.path, trip.prefill, outs[0].token_ids

    path, prefill, tokens = asyncio.run(run())
    assert path == FALLBACK and prefill is None and tokens == [10, 11, 12, 13]


def test_a_local_decode_s_own_error_is_its_answer_not_a_refusal() -> None:
    """A 500 from the decode that took the request is the request's answer: it is not run
    again through a prefill (which would hand it back to the same decode)."""

    async def run() -> tuple[int, list[str], dict[str, float]]:
        sent: list[str] = []
        broken = _answers(sent, "d", {"error": {"message": "sampling failed"}}, 500)
        s1, d = await _serve([("POST", "/v1/decode", broken)])
        s2, p = await _serve([("POST", "/v1/prefill", _answers(sent, "p", {"first_token": 9}))])
        router = _router(PDD_PREFILL_URLS=p, PDD_DECODE_URLS=d)
        await _with_sessions(router)
        router.prefill.mark(p, True)
        router.decode.mark(d, True)
        router.decode.local_prefill.add(d)
        try:
            await router.generate("a", _req(list(range(1, 40))), Trip(), None)
        except ApiError as exc:
            return exc.status, sent, _paths(router)
        finally:
            await _close(router, s1, s2)
        raise AssertionError("a decode's 500 was served")

    status, sent, paths = asyncio.run(run())
    assert status == 500 and sent == ["d"]
    assert paths == {REMOTE: 0, LOCAL: 0, FALLBACK: 0}


async def _no_probe() -> None:
    """The probe round a request may ask for sees what the last one saw."""


def test_a_local_request_every_local_decode_refused_goes_through_a_prefill() -> None:
    """The only decode that prefills prompts is draining (503); a prefill and an older decode
    are ready: the request is served through them, and counted as remote only."""

    async def run() -> tuple[str | None, list[int], dict[str, float], list[str]]:
        sent: list[str] = []
        draining = _answers(sent, "d1", {"error": {"message": "draining"}}, 503)
        prefill = _answers(sent, "p", {"first_token": 9, "finish_reason": None,
                                       "kv_transfer_params": {"pdd_grant": {}}})

        seen: list[dict[str, Any]] = []
        s1, d1 = await _serve([("POST", "/v1/decode", draining)])
        s2, d2 = await _serve([("POST", "/v1/decode", _decode_handler(seen))])
        s3, p = await _serve([("POST", "/v1/prefill", prefill)])
        router = _router(PDD_PREFILL_URLS=p, PDD_DECODE_URLS=f"{d1},{d2}",
                         PDD_ROUTER_READY_WAIT_S="30")
        await _with_sessions(router)
        router.prefill.mark(p, True)
        for url in (d1, d2):
            router.decode.mark(url, True)
        router.decode.local_prefill.add(d1)  # d2 is an older decode
        router.probe_now = _no_probe  # type: ignore[method-assign]
        router.release_soon = lambda *a, **k: None  # type: ignore[method-assign]
        trip = Trip()
        try:
            outs = await router.generate("a", _req(list(range(1, 40))), trip, None)
        finally:
            await _close(router, s1, s2, s3)
        assert seen and "local_prefill" not in seen[0]
        return trip.path, outs[0].token_ids, _paths(router), sent

    path, tokens, paths, sent = asyncio.run(run())
    assert sent == ["d1", "p"]
    assert path == REMOTE and tokens == [9, 10, 11, 12]
    assert paths == {REMOTE: 1, LOCAL: 0, FALLBACK: 0}


def test_the_warm_round_trip_is_not_counted_as_a_request() -> None:
    router = _router(PDD_PREFILL_URLS="http://p:1", PDD_DECODE_URLS="http://d:1")
    router.prefill.mark("http://p:1", True)
    router.decode.mark("http://d:1", True)

    async def post(role: str, url: str, path: str, body: dict[str, Any],
                   headers: Any = None) -> dict[str, Any]:
        return {"first_token": 5, "finish_reason": "length"}

    router._post = post  # type: ignore[method-assign]
    trip = Trip(warmup=True)
    asyncio.run(router.generate("w", _req([1, 2, 3], max_tokens=1), trip, None))
    assert trip.path == REMOTE and _paths(router) == {REMOTE: 0, LOCAL: 0, FALLBACK: 0}
    asyncio.run(router.generate("c", _req([1, 2, 3] * 100, max_tokens=1), Trip(), None))
    assert _paths(router)[REMOTE] == 1


def test_a_retry_after_a_lost_hand_off_passes_over_prefills_that_failed() -> None:
    """p1 answered 500, p2 answered but its KV could not be read: the retry does not go back to
    p1, and with no other prefill left the client gets the read's own error."""
    router = _router(PDD_PREFILL_URLS="http://p:1,http://p:2", PDD_DECODE_URLS="http://d:1",
                     PDD_ROUTER_POLICY="round-robin", PDD_ROUTER_LOCAL_PREFILL_TOKENS="0")
    for url in ("http://p:1", "http://p:2"):
        router.prefill.mark(url, True)
    router.decode.mark("http://d:1", True)
    sent: list[str] = []

    async def post(role: str, url: str, path: str, body: dict[str, Any],
                   headers: Any = None) -> dict[str, Any]:
        sent.append(url)
        if url == "http://p:1":
            raise ApiError(500, "p1 broken")
        return {"first_token": 5, "kv_transfer_params": {}}

    async def open_decode(*args: Any) -> Any:
        raise ApiError(502, "READ failed", type_="transfer")

    router._post = post  # type: ignore[method-assign]
    router._open_decode = open_decode  # type: ignore[method-assign]
    router.release_soon = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        asyncio.run(router.generate("x", _req(list(range(1, 40))), Trip(), None))
    except ApiError as exc:
        status, message = exc.status, str(exc)
    assert sent == ["http://p:1", "http://p:2"]
    assert status == 502 and "READ failed" in message


def test_probe_rounds_never_overlap() -> None:
    """The health loop's round and a request's round are one: two at once would let the older
    one's late answer overwrite the newer's."""
    router = _router(PDD_PREFILL_URLS="http://p:1", PDD_DECODE_URLS="http://d:1",
                     PDD_ROUTER_HEALTH_INTERVAL_S="0.01")
    running = [0, 0]  # now, most at once

    async def refresh() -> None:
        running[0] += 1
        running[1] = max(running[1], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1

    router.refresh = refresh  # type: ignore[method-assign]

    async def run() -> None:
        loop = asyncio.create_task(router.health_loop())
        for _ in range(10):
            await router.probe_now()
            await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(run())
    assert running[1] == 1


def _roll_router(**env: str) -> tuple[Router, dict[str, str]]:
    """A plan-changing roll as the router sees it just after the old prefill began draining:
    the old pair (plan X) ready in the last probe, the new prefill (plan Y) ready, the new
    decode not yet seen ready."""
    urls = {"p_old": "http://p-old:1", "p_new": "http://p-new:1",
            "d_old": "http://d-old:1", "d_new": "http://d-new:1"}
    router = _router(PDD_PREFILL_URLS=f"{urls['p_old']},{urls['p_new']}",
                     PDD_DECODE_URLS=f"{urls['d_old']},{urls['d_new']}",
                     PDD_ROUTER_POLICY="round-robin", PDD_ROUTER_LOCAL_PREFILL_TOKENS="0",
                     PDD_ROUTER_READY_WAIT_S="5", **env)
    for role, pool in (("p", router.prefill), ("d", router.decode)):
        for age, plan in (("old", "X"), ("new", "Y")):
            url = urls[f"{role}_{age}"]
            pool.mark(url, age == "old" or role == "p")
            pool.plans[url] = plan
    router.decode.local_prefill.update({urls["d_old"], urls["d_new"]})
    router.release_soon = lambda *a, **k: None  # type: ignore[method-assign]
    return router, urls


def _draining_prefill(router: Router, urls: dict[str, str], sent: list[str]) -> None:
    async def post(role: str, url: str, path: str, body: dict[str, Any],
                   headers: Any = None) -> dict[str, Any]:
        sent.append(url)
        if url == urls["p_old"]:
            raise ApiError(503, "not ready: draining: shutting down", type_="not_ready")
        return {"first_token": 9, "finish_reason": None, "kv_transfer_params": {}}

    router._post = post  # type: ignore[method-assign]


def test_a_draining_prefill_s_refusal_falls_back_to_its_decode() -> None:
    """The old prefill answers 503 (draining) before the next probe says so, and the new
    prefill's decode is not seen ready yet: the request is served on the old decode (the
    fallback), not refused with the draining prefill's 503."""
    router, urls = _roll_router()
    sent: list[str] = []
    opened: list[tuple[str | None, bool]] = []
    _draining_prefill(router, urls, sent)
    router.probe_now = _no_probe  # type: ignore[method-assign]

    async def open_decode(rid: str, choices: Any, pre: Any, req: GenRequest,
                          trip: Trip) -> Any:
        opened.append((trip.prefill, pre is None))
        raise ApiError(418, "stop here")  # the path is what is checked

    router._open_decode = open_decode  # type: ignore[method-assign]
    trip = Trip()
    try:
        asyncio.run(router.generate("a", _req(list(range(1, 40))), trip, None))
    except ApiError as exc:
        assert exc.status == 418, exc
    assert sent == [urls["p_old"]]
    assert trip.path == FALLBACK and opened == [(None, True)]
    assert router.prefill.healthy[urls["p_old"]] is False


def test_a_draining_prefill_s_refusal_waits_for_the_new_pair_without_the_fallback() -> None:
    """As above with the fallback off: the router probes again, sees the new decode ready and
    serves the request through the new prefill."""
    router, urls = _roll_router(PDD_ROUTER_NO_PREFILL="refuse")
    sent: list[str] = []
    _draining_prefill(router, urls, sent)
    decoded: list[tuple[str | None, Any]] = []

    async def probe() -> None:
        router.decode.mark(urls["d_new"], True)

    async def open_decode(rid: str, choices: Any, pre: Any, req: GenRequest,
                          trip: Trip) -> Any:
        decoded.append((trip.prefill, router.prefill.plans.get(trip.prefill or "")))
        raise ApiError(418, "stop here")

    router.probe_now = probe  # type: ignore[method-assign]
    router._open_decode = open_decode  # type: ignore[method-assign]
    try:
        asyncio.run(router.generate("a", _req(list(range(1, 40))), Trip(), None))
    except ApiError as exc:
        assert exc.status == 418, exc
    assert sent == [urls["p_old"], urls["p_new"]]
    assert decoded == [(urls["p_new"], "Y")]
