"""`python -m pdd_sidecar router`: OpenAI-style completions over prefill -> NIXL -> decode.

`POST /v1/completions {"prompt": "text" | [ids], "max_tokens": 16, "stream": false}`: a prompt
given as text goes through the built-in model's byte-level tokenizer. The router picks a prefill
and a decode replica round robin among those whose /readyz answered, runs the prompt on the
prefill replica, and hands its `kv_transfer_params` to the decode replica. With `"stream": true`
it answers server-sent events, one per token. If the decode side fails, the router releases the
prefill blocks at once instead of waiting for the lease.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from pdd_sidecar.serve import tokenizer
from pdd_sidecar.serve.discovery import replicas

log = logging.getLogger(__name__)

class UpstreamError(RuntimeError):
    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class Pool:
    """One role's replicas with their health, picked round robin among the healthy."""

    def __init__(self, role: str, urls: list[str], service: str) -> None:
        self.role = role
        self.static = urls
        self.service = service
        self.urls: list[str] = list(urls)
        self.healthy: dict[str, bool] = {}
        self._counter = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> str | None:  # type: ignore[assignment]
        ok = [u for u in self.urls if self.healthy.get(u) and u not in exclude]
        if not ok:
            return None
        return ok[next(self._counter) % len(ok)]

    def mark(self, url: str, healthy: bool) -> None:
        self.healthy[url] = healthy


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.prefill = Pool("prefill", settings.prefill, settings.prefill_service)
        self.decode = Pool("decode", settings.decode, settings.decode_service)
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None

    @property
    def ready(self) -> bool:
        return self.prefill.pick() is not None and self.decode.pick() is not None

    async def refresh(self) -> None:
        assert self.session is not None
        for pool in (self.prefill, self.decode):
            pool.urls = await replicas(pool.static, pool.service)

            async def probe(url: str, pool: Pool = pool) -> None:
                try:
                    timeout = aiohttp.ClientTimeout(total=2)
                    async with self.session.get(f"{url}/readyz", timeout=timeout) as resp:  # type: ignore[union-attr]
                        ok = resp.status == 200
                except (TimeoutError, aiohttp.ClientError, OSError):
                    ok = False
                if ok != pool.healthy.get(url):
                    log.info("%s replica %s is %s", pool.role, url, "ready" if ok else "not ready")
                pool.mark(url, ok)
                self.metrics.healthy.labels(role=pool.role, replica=url).set(1 if ok else 0)

            await asyncio.gather(*(probe(u) for u in pool.urls))

    async def health_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # keep probing whatever happened
                log.warning("health probe round failed: %s", exc)
            await asyncio.sleep(self.settings.health_interval_s)

    async def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.session is not None
        try:
            async with self.session.post(f"{url}{path}", json=body) as resp:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    raise UpstreamError(f"{url}{path}: {data.get('error', data)}", resp.status)
                return data  # type: ignore[no-any-return]
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            raise UpstreamError(f"{url}{path}: {type(exc).__name__}: {exc}") from None

    async def run_prefill(self, rid: str, prompt: list[int]) -> tuple[str, dict[str, Any]]:
        tried: set[str] = set()
        last: UpstreamError | None = None
        while True:
            url = self.prefill.pick(tried)
            if url is None:
                raise last or UpstreamError("no ready prefill replica", 503)
            tried.add(url)
            try:
                return url, await self._post(url, "/v1/prefill",
                                             {"request_id": rid, "prompt_ids": prompt})
            except UpstreamError as exc:
                if exc.status < 500:
                    raise
                log.warning("prefill replica failed, trying another: %s", exc)
                if exc.status == 502:  # unreachable: skip it until the next probe says ready
                    self.prefill.mark(url, False)
                last = exc

    async def release(self, prefill_url: str, rid: str) -> None:
        try:
            await self._post(prefill_url, "/v1/release", {"request_id": rid})
        except UpstreamError as exc:
            log.info("release of %s on %s failed (the lease will free it): %s", rid,
                     prefill_url, exc)


ROUTER = web.AppKey("router", Router)


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise UpstreamError("prompt is empty", 400)
        return tokenizer.encode(prompt)
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return list(prompt)
    raise UpstreamError("prompt must be a non-empty string or list of token ids", 400)


def _choice(ids: list[int], text_prompt: bool) -> dict[str, Any]:
    return {"index": 0, "token_ids": ids, "text": tokenizer.decode(ids) if text_prompt else "",
            "finish_reason": "length"}


async def completions(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    start = time.monotonic()
    outcome = "error"
    try:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UpstreamError("request body must be JSON", 400) from None
        if not isinstance(body, dict):
            raise UpstreamError("request body must be a JSON object", 400)
        prompt = _prompt_ids(body)
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise UpstreamError("max_tokens must be an integer >= 1", 400)
        text_prompt = isinstance(body.get("prompt"), str)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        prefill_url, pre = await router.run_prefill(rid, prompt)
        first = int(pre["first_token"])
        decode_url = None
        if max_tokens > 1:
            decode_url = router.decode.pick()
            if decode_url is None:
                await router.release(prefill_url, rid)
                raise UpstreamError("no ready decode replica", 503)
        dec_body = {"request_id": rid, "first_token": first, "max_new_tokens": max_tokens - 1,
                    "kv_transfer_params": pre["kv_transfer_params"]}
        meta = {"prefill": prefill_url, "decode": decode_url}
        if body.get("stream"):
            response = await _stream(request, router, rid, prompt, first, decode_url,
                                     prefill_url, dec_body, meta, text_prompt)
            outcome = "ok"
            return response
        tokens = [first]
        transfer = None
        if decode_url is not None:
            try:
                dec = await router._post(decode_url, "/v1/decode", dec_body)
            except UpstreamError:
                await router.release(prefill_url, rid)
                raise
            tokens += dec["token_ids"]
            transfer = dec["transfer"]
        else:
            await router.release(prefill_url, rid)
        outcome = "ok"
        return web.json_response({
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": body.get("model", "pdd"),
            "choices": [_choice(tokens, text_prompt)],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
            "pdd": {**meta, "transfer": transfer},
        })
    except UpstreamError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    finally:
        router.metrics.requests.labels(outcome=outcome).inc()
        router.metrics.request_seconds.observe(time.monotonic() - start)


async def _stream(request: web.Request, router: Router, rid: str, prompt: list[int], first: int,
                  decode_url: str | None, prefill_url: str, dec_body: dict[str, Any],
                  meta: dict[str, Any], text_prompt: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def event(data: dict[str, Any] | str) -> None:
        payload = data if isinstance(data, str) else json.dumps(data)
        await response.write(f"data: {payload}\n\n".encode())

    def chunk(tok: int) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion",
                "choices": [{"index": 0, "token_ids": [tok],
                             "text": tokenizer.decode([tok]) if text_prompt else "",
                             "finish_reason": None}]}

    await event(chunk(first))
    if decode_url is None:
        await router.release(prefill_url, rid)
    else:
        assert router.session is not None
        ok = False
        try:
            async with router.session.post(f"{decode_url}/v1/decode",
                                           json={**dec_body, "stream": True}) as resp:
                if resp.status != 200:
                    data = await resp.json(content_type=None)
                    await event({"error": f"{decode_url}/v1/decode: {data.get('error', data)}"})
                else:
                    async for line in resp.content:
                        if not line.strip():
                            continue
                        msg = json.loads(line)
                        if "token" in msg:
                            await event(chunk(int(msg["token"])))
                        elif "error" in msg:
                            await event({"error": f"{decode_url}/v1/decode: {msg['error']}"})
                        else:
                            ok = True
                            await event({"id": rid, "pdd": {**meta,
                                                            "transfer": msg.get("transfer")}})
        except (TimeoutError, aiohttp.ClientError) as exc:
            await event({"error": f"{decode_url}/v1/decode: {type(exc).__name__}: {exc}"})
        if not ok:
            await router.release(prefill_url, rid)
    await event("[DONE]")
    await response.write_eof()
    return response


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    body = {
        "ready": router.ready,
        "prefill": {u: router.prefill.healthy.get(u, False) for u in router.prefill.urls},
        "decode": {u: router.decode.healthy.get(u, False) for u in router.decode.urls},
    }
    return web.json_response(body, status=200 if router.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ROUTER].metrics.expose(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(settings: RouterSettings) -> web.Application:
    router = Router(settings)
    app = web.Application()
    app[ROUTER] = router
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)

    async def lifecycle(app: web.Application) -> Any:
        router.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.request_timeout_s)
        )
        await router.refresh()
        task = asyncio.create_task(router.health_loop())
        yield
        task.cancel()
        await router.session.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def main(env: Mapping[str, str] | None = None) -> int:
    try:
        settings = RouterSettings.from_env(env)
    except ConfigError as exc:
        print(f"pdd-router: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=os.environ.get("PDD_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s router %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    log.info("router on %s:%d; prefill %s %s; decode %s %s", settings.bind_host, settings.port,
             settings.prefill, settings.prefill_service, settings.decode, settings.decode_service)
    web.run_app(build_app(settings), host=settings.bind_host, port=settings.port, print=None,
                access_log=None)
    return 0
