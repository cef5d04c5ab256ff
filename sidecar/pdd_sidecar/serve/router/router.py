"""`python -m pdd_sidecar router`: the OpenAI-compatible front end over prefill -> NIXL -> decode.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (messages rendered through the
checkpoint's chat template, see serve/openai/text.py), `GET /v1/models`, plus `/healthz`, `/readyz`,
`/metrics`. Each request runs its prompt on a prefill replica (chosen among the ready ones by
`PDD_ROUTER_POLICY`, routing_policy.py: by prompt prefix and load unless set otherwise; a
5xx or unreachable replica is retried on another, a 4xx is the client's answer) and
hands the prefill's `kv_transfer_params` to a decode replica, whose tokens the router always
reads as a stream: that is how it applies stop strings and honours a client that went away
(closing the decode stream cancels the sequence; the prefill gets a /v1/release). Bad input is
refused here, before any replica works on it, with OpenAI-style error JSON naming the field.

Request parsing lives in serve/openai/openai_request.py, the replicas and the hand-off client in
serve/router/upstreams.py; this module holds the aiohttp app, its handlers and the SSE framing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.gc_pauses import freeze_heap
from pdd_sidecar.metrics import CONTENT_TYPE_LATEST, OPENMETRICS_TYPE, wants_openmetrics
from pdd_sidecar.serve import access_log
from pdd_sidecar.serve.discovery import DEFAULT_KEEPALIVE_S, KEEPALIVE_S, fresh_dns_connector
from pdd_sidecar.serve.event_loop import loop_kind, new_event_loop, uvloop_installed
from pdd_sidecar.serve.openai.api_keys import ApiKeys, KeyFileError, key_check
from pdd_sidecar.serve.openai.choices import choice_body, choice_index, usage
from pdd_sidecar.serve.openai.completion_output import Output
from pdd_sidecar.serve.openai.logprob_format import LogprobText, with_first_null
from pdd_sidecar.serve.openai.openai_request import (
    ApiError,
    GenRequest,
    bad,
    brief_repr,
    parse_requests,
)
from pdd_sidecar.serve.openai.sse_chunks import ChunkFormat, sse
from pdd_sidecar.serve.openai.text import ModelText, TextConfigError, load_model_text
from pdd_sidecar.serve.router import spans
from pdd_sidecar.serve.router.router_workers import run_workers
from pdd_sidecar.serve.router.start_gate import StartGate, units_of
from pdd_sidecar.serve.router.upstreams import Emit, Router, Step, Trip

log = logging.getLogger(__name__)


ROUTER = web.AppKey("router", Router)
START_GATE = web.AppKey("start_gate", StartGate)
INLINE_PARSE_BYTES = 16 << 10


async def _read_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[ROUTER].settings.max_body_bytes
        raise ApiError(413, f"request body larger than {limit} bytes", None) from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise bad("request body must be JSON", None) from None
    except RecursionError:
        raise bad("request body must be JSON: nested too deep", None) from None


# One prompt's run: its request, its trip and each choice's output.
Run = tuple[GenRequest, Trip, list[Output]]


def _usage(runs: list[Run]) -> dict[str, Any]:
    return usage([len(req.prompt_ids) for req, _, _ in runs],
                 [len(o.token_ids) for _, _, outs in runs for o in outs],
                 sum(trip.cached_tokens for _, trip, _ in runs))


async def _each(coros: list[Awaitable[Any]]) -> list[Any]:
    """Run concurrently; the first failure, or this task's cancellation (a client gone),
    cancels the rest, which are awaited (their upstreams closed, their grants released)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    router = request.app[ROUTER]
    start = time.monotonic()
    outcome = "error"
    trace = spans.RequestSpan.start(request, kind, router.settings.model_name, start)
    status, error, trips = 500, None, []
    try:
        body = await _read_body(request)
        args = (kind, body, router.model, router.settings.model_name, router.max_model_len())
        # A small body (a prompt of a thousand token ids) is checked in ~0.1 ms, less than the
        # hop to a thread, whose GIL contention would hold up this loop (and its probes) under
        # a burst; tokenizing a long text or rendering a long chat goes off the loop.
        size = request.content_length  # None when sent in chunks: size unknown
        small = size is not None and size <= INLINE_PARSE_BYTES
        if small:
            # A burst is checked, routed and sent on a bounded amount per loop turn (what runs
            # up to the prefill's connection runs in the turn the gate let it in).
            await request.app[START_GATE].enter(units_of(size or 0))
            reqs = parse_requests(*args)
        else:
            reqs = await asyncio.to_thread(parse_requests, *args)
        req = reqs[0]  # the fields every prompt shares
        if router.settings.upstream_protocol == "vllm" and (
                req.logprobs is not None or req.prompt_logprobs is not None or req.echo):
            field = "echo" if req.echo else "logprobs" if req.logprobs is not None \
                else "prompt_logprobs"
            raise bad(f"{field}: not served through vLLM upstreams "
                      "(PDD_ROUTER_UPSTREAM_PROTOCOL=vllm)", field)
        for req in reqs:
            router.check_capacity(req, "max_completion_tokens" if kind == "chat"
                                  and body.get("max_completion_tokens") is not None
                                  else "max_tokens")
        # Each prompt of a list is a request in flight (the middleware counted one).
        extra = len(reqs) - 1
        if extra and router.in_flight + extra > router.settings.max_concurrency:
            router.metrics.requests.labels(outcome="overloaded").inc()
            raise ApiError(429, f"the router has {router.in_flight} requests in flight (limit "
                           f"{router.settings.max_concurrency}); this one has {len(reqs)} "
                           "prompts", headers={"Retry-After": "1"})
        router.in_flight += extra
        try:
            prefix = "cmpl" if kind == "completion" else "chatcmpl"
            rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
            trips = [Trip() for _ in reqs]
            for trip in trips:
                trip.stamps[timing.R_RECEIVED] = start
                trip.trace = trace.context if trace is not None else None
            if trace is not None:
                trace.requested(rid, reqs)
            if reqs[0].stream:
                response = await _stream(request, router, rid, reqs, trips)
            else:
                if len(reqs) == 1:
                    outs = [await router.generate(rid, reqs[0], trips[0], None)]
                else:
                    outs = await _each([router.generate(f"{rid}-{i}", r, t, None)
                                        for i, (r, t) in enumerate(zip(reqs, trips,
                                                                       strict=True))])
                runs = list(zip(reqs, trips, outs, strict=True))
                response = web.json_response(_final_body(router, rid, runs))
        finally:
            router.in_flight -= extra
        outcome = "ok"
        status = response.status
        return response
    except ApiError as exc:
        status, error = exc.status, str(exc)
        return exc.response()
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "cancelled"
        error = "cancelled: the client went away"
        raise
    finally:
        if trace is not None:
            trace.end(status, error, trips)
        router.metrics.requests.labels(outcome=outcome).inc()
        router.metrics.request_seconds.observe(time.monotonic() - start)


def _logprob_text(router: Router, req: GenRequest) -> LogprobText:
    codec = router.model.codec
    return LogprobText(codec.decode if codec is not None else None, req.tokens_as_ids)


def _echo_text(router: Router, req: GenRequest) -> str:
    """The prompt as the client sent it, or its token ids' text."""
    if req.prompt_text is not None:
        return req.prompt_text
    codec = router.model.codec
    return codec.decode(req.prompt_ids) if codec is not None else ""


def _token_logprobs(lt: LogprobText, req: GenRequest, ids: list[int], entries: list[Any],
                    trip: Trip, prompt: bool) -> dict[str, Any] | None:
    """The choice's ``logprobs`` for generated ``ids``; ``prompt``: an echoed prompt's first."""
    if req.logprobs is None:
        return None
    if req.kind == "chat":
        return lt.chat(ids, entries)
    if prompt and req.echo:
        return lt.completion([*req.prompt_ids, *ids],
                             [*with_first_null(trip.prompt_logprobs), *entries])
    return lt.completion(ids, entries)


def _choice(router: Router, req: GenRequest, out: Output, trip: Trip, index: int,
            choice_of: int = 0) -> dict[str, Any]:
    """One choice of a final answer (serve/openai/choices.py), with what it asked for besides: the
    echoed prompt, log-probabilities (``choice_of``: its index among its prompt's n)."""
    text = _echo_text(router, req) + out.text if req.echo and req.kind == "completion" \
        else out.text
    choice = choice_body(req.kind, index, text, out.token_ids, out.finish, out.tool_calls)
    if req.logprobs is not None or req.vllm_prompt_logprobs:
        lt = _logprob_text(router, req)
        n = len(out.token_ids)
        choice["logprobs"] = _token_logprobs(lt, req, out.token_ids,
                                             trip.logprobs[choice_of][:n], trip, True)
        if req.vllm_prompt_logprobs:
            choice["prompt_logprobs"] = lt.prompt_logprobs(
                req.prompt_ids, with_first_null(trip.prompt_logprobs))
    return choice


def _final_body(router: Router, rid: str, runs: list[Run]) -> dict[str, Any]:
    kind = runs[0][0].kind
    choices = [_choice(router, req, out, trip, choice_index(i, j, req.n), j)
               for i, (req, trip, outs) in enumerate(runs) for j, out in enumerate(outs)]
    meta = runs[0][1].meta() if len(runs) == 1 else {
        "prompts": [trip.meta() for _, trip, _ in runs]}
    return {"id": rid, "object": "text_completion" if kind == "completion"
            else "chat.completion", "created": int(time.time()),
            "model": router.settings.model_name, "choices": choices,
            "usage": _usage(runs), "pdd": meta}


async def _stream(request: web.Request, router: Router, rid: str, reqs: list[GenRequest],
                  trips: list[Trip]) -> web.StreamResponse:
    """Server-sent events in OpenAI's chunk formats, then `data: [DONE]`: each chunk one
    choice's (its `index`), choices and prompts interleaved as their tokens come.

    The response starts with the prefill's token, before the hand-off to a decode: errors
    before it keep their HTTP status, later ones (a decode refusing) arrive as an
    `{"error": ...}` event.
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    req = reqs[0]
    fmt = ChunkFormat(rid, req.kind, int(time.time()), router.settings.model_name,
                      req.include_usage)
    lock = asyncio.Lock()  # several prompts' tasks write to the one response

    def emitter(prompt: int, r: GenRequest, trip: Trip, answers: list[Output]) -> Emit:
        """The events of one prompt's choices; ``answers`` are its outputs as they grow (a
        step's tool-call deltas are read from them)."""
        seen = [0] * len(answers)
        began = False
        # Each choice's own text offsets (a completion's text_offset runs on over its chunks).
        lts = [_logprob_text(router, r) for _ in answers]

        async def emit(choice: int, steps: list[Step]) -> None:
            nonlocal began
            events: list[bytes] = []
            async with lock:
                if not response.prepared:
                    await response.prepare(request)
                    if req.kind == "chat":
                        events.extend(fmt.role(j) for j in range(req.n))
                if not began:
                    began = True
                    if r.echo or r.vllm_prompt_logprobs:  # every choice's, as OpenAI's
                        events.extend(_prompt_event(router, r, fmt, lts[j], trip,
                                                    choice_index(prompt, j, r.n))
                                      for j in range(r.n))
                index = choice_index(prompt, choice, r.n)
                answer = answers[choice]
                for tokens, text, finish in steps:
                    lp = None
                    if r.logprobs is not None:  # this step's tokens' entries, in order
                        at = seen[choice]
                        lp = _token_logprobs(lts[choice], r, tokens,
                                             trip.logprobs[choice][at:at + len(tokens)],
                                             trip, False)
                    seen[choice] += len(tokens)
                    extra = {"pdd": trip.meta()} if finish else None
                    calls = (answer.pop_tool_deltas(seen[choice]) if answer.tools is not None
                             else [])
                    events.append(fmt.tool_step(tokens, text, calls, finish, extra, lp, index)
                                  if calls else fmt.step(tokens, text, finish, extra, lp, index))
                await response.write(b"".join(events))
        return emit

    def run(i: int, r: GenRequest, t: Trip, sub: str) -> Awaitable[list[Output]]:
        answers = [Output(r, router.model) for _ in range(r.n)]
        return router.generate(sub, r, t, emitter(i, r, t, answers), answers)

    # The stream's last events go out with its end, in one write.
    try:
        if len(reqs) == 1:
            outs = [await run(0, req, trips[0], rid)]
        else:
            outs = await _each([run(i, r, t, f"{rid}-{i}")
                                for i, (r, t) in enumerate(zip(reqs, trips, strict=True))])
    except ApiError as exc:
        if not response.prepared:
            raise
        await response.write_eof(sse(exc.body()) + sse("[DONE]"))
        return response
    tail = b""
    if req.include_usage:
        tail = sse(fmt.usage(_usage(list(zip(reqs, trips, outs, strict=True)))))
    await response.write_eof(tail + sse("[DONE]"))
    return response


def _prompt_event(router: Router, req: GenRequest, fmt: ChunkFormat, lt: LogprobText,
                  trip: Trip, index: int = 0) -> bytes:
    """A streamed completion's first event when it echoes the prompt or sends vLLM's
    prompt_logprobs: the prompt's text and log-probabilities, before any generated token."""
    text = _echo_text(router, req) if req.echo else ""
    lp = None
    if req.echo and req.logprobs is not None:
        lp = lt.completion(req.prompt_ids, with_first_null(trip.prompt_logprobs))
    choice = fmt.choice([], text, None, lp, index)
    if req.vllm_prompt_logprobs:
        choice["prompt_logprobs"] = lt.prompt_logprobs(req.prompt_ids,
                                                       with_first_null(trip.prompt_logprobs))
    return sse(fmt.chunk(choice))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


def _model_card(router: Router) -> dict[str, Any]:
    return {"id": router.settings.model_name, "object": "model", "created": router.created,
            "owned_by": "pdd", "root": router.model.source,
            "max_model_len": router.max_model_len()}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[ROUTER])]})


async def model_card(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    name = request.match_info["name"]
    if name != router.settings.model_name:
        return ApiError(404, f"the model {brief_repr(name)} does not exist; this server serves "
                        f"{router.settings.model_name!r}", "model", "not_found_error",
                        "model_not_found").response()
    return web.json_response(_model_card(router))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    ready = router.ready
    body: dict[str, Any] = {
        "ready": ready,
        "warm": router.warm.done,
        "prefill": {u: router.prefill.healthy.get(u, False) for u in router.prefill.urls},
        "decode": {u: router.decode.healthy.get(u, False) for u in router.decode.urls},
    }
    workers, warm = router.settings.workers, router.workers_warm
    if workers > 1:
        body["workers_warm"] = f"{warm}/{workers}"
    if not ready:
        body["reason"] = ("no ready prefill with a ready decode of its routing plan"
                          + ("" if router.settings.no_prefill == "refuse" else
                             ", and no ready decode to fall back on")
                          if not router.routable else
                          "warm round trip not done yet" + (f" (last: {router.warm.last_error})"
                                                            if router.warm.last_error else "")
                          if not router.warm.done else
                          f"{workers - warm} of the {workers} workers have not run their warm "
                          "round trip yet")
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    om = wants_openmetrics(request.headers.get("Accept", ""))
    return web.Response(body=request.app[ROUTER].metrics.expose(om),
                        headers={"Content-Type": OPENMETRICS_TYPE if om else CONTENT_TYPE_LATEST})


@web.middleware
async def openai_errors(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                        ) -> web.StreamResponse:
    """aiohttp's own refusals (404, 405, 413) in the same error format as the rest, and the
    bound on requests in flight (429 beyond it, before any work is done)."""
    router = request.app[ROUTER]
    if request.method == "POST" and router.in_flight >= router.settings.max_concurrency:
        router.metrics.requests.labels(outcome="overloaded").inc()
        return ApiError(429, f"the router has {router.in_flight} requests in flight (limit "
                        f"{router.settings.max_concurrency})", headers={"Retry-After": "1"}
                        ).response()
    router.in_flight += 1
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}"
                        if exc.status != 413 else
                        f"request body larger than "
                        f"{request.app[ROUTER].settings.max_body_bytes} bytes").response()
    finally:
        router.in_flight -= 1


def build_app(settings: RouterSettings, model: ModelText | None = None) -> web.Application:
    if model is None:
        model = load_model_text(settings.model_source, settings.max_model_len or None)
    router = Router(settings, model)
    keys = ApiKeys(settings.api_keys, settings.api_key_file)  # KeyFileError: refuse to start
    middlewares = [access_log.middleware(access_log.enabled()),
                   *([key_check(keys)] if keys.enabled else []), openai_errors]
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    app[ROUTER] = router
    app[START_GATE] = StartGate()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model_card)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)

    async def lifecycle(app: web.Application) -> Any:
        router.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=settings.request_timeout_s or None),
            read_bufsize=1 << 22,
            connector=fresh_dns_connector(
                limit=2 * settings.max_concurrency,
                # pdd instances keep idle connections longer than this (serve/
                # connection_warmer.py); another server's own keep-alive is unknown
                keepalive_s=KEEPALIVE_S if settings.upstream_protocol == "pdd"
                else DEFAULT_KEEPALIVE_S),
        )
        router.probe_session = aiohttp.ClientSession(connector=fresh_dns_connector())
        await router.refresh()
        task = asyncio.create_task(router.health_loop())
        # What lives as long as the process (the model's text tables, the app) is kept out of
        # the collector's sight: a full collection under 256 streams would walk it on the loop
        # (the instances freeze after their warm-up too).
        freeze_heap()
        router.metrics.gc_pauses.install()
        yield
        router.metrics.gc_pauses.remove()
        task.cancel()
        await router.warm.stop()
        if router.warmer is not None:
            await router.warmer.stop()
        await router.session.close()
        await router.probe_session.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def main(env: Mapping[str, str] | None = None) -> int:
    try:
        settings = RouterSettings.from_env(env)
        model = load_model_text(settings.model_source, settings.max_model_len or None)
        loop = loop_kind(settings.event_loop, uvloop_installed())
        if settings.api_key_file:
            ApiKeys((), settings.api_key_file)
        tracing.settings_from_env("router", env)  # OTEL_* it cannot serve: refused
    except (ConfigError, TextConfigError, KeyFileError, tracing.TracingConfigError) as exc:
        print(f"pdd-router: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    who = "router" if settings.worker is None else f"router[{settings.worker}]"
    logging.basicConfig(
        level=os.environ.get("PDD_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if settings.workers > 1 and settings.worker is None:
        return run_workers(settings)
    tracing.setup("router", env)  # each worker process exports its own requests' spans
    log.info("router on %s:%d serving %s (%s, max length %d); prefill %s %s; decode %s %s",
             settings.bind_host, settings.port, settings.model_name, model.source,
             model.max_model_len, settings.prefill, settings.prefill_service, settings.decode,
             settings.decode_service)
    # handler_cancellation: a client that goes away cancels its handler at once, which closes
    # the decode stream and releases the prefill (see Router.tokens). Workers share the port.
    web.run_app(build_app(settings, model), host=settings.bind_host, port=settings.port,
                print=None, access_log=None, handler_cancellation=True,
                reuse_port=settings.worker is not None,
                loop=new_event_loop(loop, who))
    return 0
