"""Decode instance API: READ the prompt's KV from a prefill instance, then decode greedily.

`POST /v1/decode {"request_id", "first_token", "max_new_tokens", "kv_transfer_params",
"stream"}`: every rank reads exactly the chunks the routing plan gives it, notifies the prefill
ranks the plan names, and the instance decodes `max_new_tokens` tokens after `first_token`.
With `"stream": true` the answer is NDJSON, one `{"token": id}` line per token and a final line
with the totals. A failed hand-off answers an error naming the peer; the decode's blocks are
freed either way.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pdd_sidecar.engine.instance import RequestError
from pdd_sidecar.serve.discovery import replicas
from pdd_sidecar.serve.server import STATE, InstanceState, error_response, first_error, read_json


def _parse(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RequestError("kv_transfer_params must be an object", 400)
    try:
        first = int(body["first_token"])
        max_new = int(body.get("max_new_tokens", 16))
    except (KeyError, TypeError, ValueError):
        raise RequestError("first_token and max_new_tokens must be integers", 400) from None
    if max_new < 0:
        raise RequestError("max_new_tokens must be >= 0", 400)
    return {
        "op": "decode",
        "id": str(body.get("request_id") or uuid.uuid4().hex),
        "first_token": first,
        "max_new": max_new,
        "source": params,
    }


def _summary(state: InstanceState, cmd: dict[str, Any], results: list[Any]) -> dict[str, Any]:
    m = state.metrics
    ranks = []
    for rank, r in enumerate(results):
        t = r["transfer"]
        m.transfer_bytes.labels(rank=str(rank)).inc(t["bytes"])
        m.transfer_descriptors.labels(rank=str(rank)).inc(t["descriptors"])
        m.transfer_seconds.labels(rank=str(rank)).observe(t["seconds"])
        ranks.append({"rank": rank, **t})
    m.tokens.labels(kind="generated").inc(len(results[0]["tokens"]))
    return {
        "request_id": cmd["id"],
        "token_ids": results[0]["tokens"],
        "transfer": {
            "bytes": sum(r["bytes"] for r in ranks),
            "descriptors": sum(r["descriptors"] for r in ranks),
            "ranks": ranks,
        },
    }


async def decode(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    m = state.metrics
    start = time.monotonic()
    outcome = "error"
    try:
        if not state.ranks_ready or state.draining:
            raise RequestError(f"not ready: {state.not_ready_reason}", 503, "not_ready")
        body = await read_json(request)
        cmd = _parse(body)
        if body.get("stream"):
            response = await _stream(request, state, cmd)
            outcome = "ok"
            return response
        results = await state.call(cmd)
        err = first_error(results)
        if err:
            m.transfer_failures.labels(reason=err.kind).inc()
            raise err
        outcome = "ok"
        return web.json_response(_summary(state, cmd, results))
    except Exception as exc:
        return error_response(exc)
    finally:
        m.requests.labels(role="decode", endpoint="decode", outcome=outcome).inc()
        m.request_seconds.labels(role="decode", endpoint="decode").observe(
            time.monotonic() - start)


async def _stream(request: web.Request, state: InstanceState,
                  cmd: dict[str, Any]) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue[int] = asyncio.Queue()
    def on_token(token: int) -> None:
        loop.call_soon_threadsafe(tokens.put_nowait, token)

    fut = asyncio.wrap_future(state.driver.submit(cmd, on_token))
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    while True:
        getter = asyncio.ensure_future(tokens.get())
        done, _ = await asyncio.wait({getter, fut}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            await response.write(json.dumps({"token": getter.result()}).encode() + b"\n")
            continue
        getter.cancel()
        break
    while not tokens.empty():
        await response.write(json.dumps({"token": tokens.get_nowait()}).encode() + b"\n")
    try:
        results = fut.result()
        err = first_error(results)
        if err:
            state.metrics.transfer_failures.labels(reason=err.kind).inc()
            final: dict[str, Any] = {"error": str(err), "status": err.status}
        else:
            final = {"done": True, **_summary(state, cmd, results)}
    except Exception as exc:
        final = {"error": f"{type(exc).__name__}: {exc}", "status": 500}
    await response.write(json.dumps(final).encode() + b"\n")
    await response.write_eof()
    return response


async def watch_prefill_peers(state: InstanceState) -> None:
    """Ready only once every configured prefill instance answered the handshake on all ranks.

    A peer that later dies does not make this instance unready (the router routes around it);
    an incompatible peer keeps it unready with the reason, since every request to it would fail.
    """
    s = state.settings
    done: set[str] = set()
    while not state.ranks_ready:
        await asyncio.sleep(0.2)
    timeout = aiohttp.ClientTimeout(total=s.handshake_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            urls = await replicas(s.prefill_urls, s.prefill_service)
            problems = []
            for url in urls:
                if url in done:
                    continue
                try:
                    async with session.get(f"{url}/v1/info") as resp:
                        info = await resp.json()
                    results = await state.call({
                        "op": "handshake", "host": info["host"],
                        "side_channel_port": info["side_channel_port"],
                        "instance_id": info["instance_id"], "tp": info["tp"], "dcp": info["dcp"],
                    })
                    err = first_error(results)
                    if err:
                        raise err
                    done.add(url)
                    state.peer_status[url] = "ok"
                except Exception as exc:
                    msg = str(exc) or type(exc).__name__
                    state.peer_status[url] = msg
                    problems.append(f"{url}: {msg}")
            state.peers_ready = bool(urls) and not problems if (
                s.prefill_urls or s.prefill_service) else True
            if state.peers_ready:
                state.not_ready_reason = ""
            else:
                state.not_ready_reason = (
                    "prefill peers have not answered the handshake: " + "; ".join(problems)
                    if problems else "no prefill peers found"
                )
            await asyncio.sleep(1.0 if not state.peers_ready else 5.0)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/decode", decode)
