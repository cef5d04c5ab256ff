"""`python -m pdd_sidecar router`: the OpenAI-compatible front end over prefill -> NIXL -> decode.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (messages rendered through the
checkpoint's chat template, see serve/text.py), `GET /v1/models`, plus `/healthz`, `/readyz`,
`/metrics`. Each request runs its prompt on a prefill replica (round robin among the ready
ones; a 5xx or unreachable replica is retried on another, a 4xx is the client's answer) and
hands the prefill's `kv_transfer_params` to a decode replica, whose tokens the router always
reads as a stream: that is how it applies stop strings and honours a client that went away
(closing the decode stream cancels the sequence; the prefill gets a /v1/release). Bad input is
refused here, before any replica works on it, with OpenAI-style error JSON naming the field.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import secrets
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdd_sidecar.engine import timing
from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from pdd_sidecar.serve.discovery import fresh_dns_connector, replicas
from pdd_sidecar.serve.text import (
    IncrementalDetokenizer,
    ModelText,
    StopStrings,
    TemplateRenderError,
    TextConfigError,
    chat_ids,
    load_model_text,
)

log = logging.getLogger(__name__)

INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_STRINGS = 4


class ApiError(Exception):
    """An answer in OpenAI's error format: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or self.TYPES.get(status) or (
            "invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


class Pool:
    """One role's replicas with their health, picked round robin among the healthy."""

    def __init__(self, role: str, urls: list[str], service: str) -> None:
        self.role = role
        self.static = urls
        self.service = service
        self.urls: list[str] = list(urls)
        self.healthy: dict[str, bool] = {}
        self.plans: dict[str, str] = {}  # replica -> digest of the routing plan it runs
        self.capacity: dict[str, int] = {}  # replica -> KV tokens one sequence can hold there
        self._counter = itertools.count()

    def pick(self, exclude: set[str] = frozenset(),  # type: ignore[assignment]
             plan: str | None = None, plans: set[str] | None = None) -> str | None:
        """Round robin among the ready replicas; with ``plan``, only among those running that
        routing plan (a prefill and a decode of different plans cannot hand KV over); with
        ``plans``, only among those running one of them."""
        ok = [u for u in self.urls if self.healthy.get(u) and u not in exclude
              and (plan is None or self.plans.get(u, plan) == plan)
              and (plans is None or u not in self.plans or self.plans[u] in plans)]
        if not ok:
            return None
        return ok[next(self._counter) % len(ok)]

    def mark(self, url: str, healthy: bool) -> None:
        self.healthy[url] = healthy

    def largest_capacity(self) -> int | None:
        """The most KV tokens one sequence can hold on any ready replica; None when a ready
        replica does not say (or none is ready), so nothing is refused on a guess."""
        ready = [u for u in self.urls if self.healthy.get(u)]
        if not ready or any(u not in self.capacity for u in ready):
            return None
        return max(self.capacity[u] for u in ready)

    def ready_plans(self) -> set[str] | None:
        """The routing plans some ready replica runs; None when a ready replica does not say
        (then nothing can be excluded)."""
        ready = [u for u in self.urls if self.healthy.get(u)]
        if any(u not in self.plans for u in ready):
            return None
        return {self.plans[u] for u in ready}


# ---------------------------------------------------------------- request validation
@dataclass
class GenRequest:
    """One validated completion request, in the terms the instances speak."""

    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    local_stop_ids: frozenset[int] = frozenset()


def _show(v: Any, limit: int = 80) -> str:
    """A client's value in an error message, cut short (it may be megabytes)."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))  # ints: no float()


def _check_strings(value: Any, path: str, top: str) -> None:
    """JSON may carry lone surrogates (`"\\ud800"`), which no tokenizer can encode.

    A loop, not recursion: a body nested as deep as the JSON parser allows must not reach
    Python's recursion limit here."""
    todo: list[tuple[Any, str]] = [(value, path)]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                where = path if len(path) <= 80 else path[:80] + "..."
                raise bad(f"{where}: contains an unpaired surrogate, not valid Unicode text",
                          top) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, path))
                todo.append((v, f"{path}.{k}"))
        elif isinstance(value, list):
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(value))


def _opt_int(body: Mapping[str, Any], key: str, default: int | None, lo: int | None = None,
             hi: int | None = None, what: str = "") -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"{key} must be an integer{what}, got {_show(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"{key} must be an integer{what}, got {v}", key)
    return int(v)


def _opt_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {_show(v)}", key)
    return v


def _opt_number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
                lo_open: bool, what: str) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v) or (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(f"{key} must be a number in {what}, got {_show(v)}", key)
    return float(v)


def _ids(value: Any, model: ModelText, param: str) -> list[int] | None:
    """A list of token ids, validated against the vocabulary; None if it is not a list of ints."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        return None
    bad_ids = [t for t in value if not 0 <= t < model.vocab_size]
    if bad_ids:
        raise bad(f"{param}: token ids must be in [0, {model.vocab_size}) (the model's "
                  f"vocabulary), got {bad_ids[:5]}", param)
    return list(value)


def _need_codec(model: ModelText, param: str) -> Any:
    if model.codec is None:
        raise bad(f"{param}: the model at {model.source} has no tokenizer "
                  f"({model.missing_tokenizer}); send the prompt as token ids", param)
    return model.codec


def _prompt_ids(body: Mapping[str, Any], model: ModelText) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"prompt: batches of prompts are not supported, got {len(prompt)} prompts "
                  "(send one request per prompt)", "prompt")
    if isinstance(prompt, str):
        codec = _need_codec(model, "prompt")
        ids = list(codec.encode(prompt, add_special_tokens=True))
    else:
        ids_or_none = _ids(prompt, model, "prompt")
        if ids_or_none is None:
            raise bad("prompt must be a string, a list of token ids, or a list holding one "
                      "of those", "prompt")
        ids = ids_or_none
    if not ids:
        raise bad("prompt is empty (no tokens)", "prompt")
    return ids


def _content_text(content: Any, where: str) -> str | None:
    """Message content: a string, or OpenAI content parts of type text (joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise bad(f"{where}[{i}]: only text content parts "
                          '({"type": "text", "text": ...}) are supported', "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", "messages")


def _chat_prompt(body: Mapping[str, Any], model: ModelText) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    conv = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role must be a non-empty string", "messages")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), f"messages[{i}].content")
        conv.append(msg)
    for key in ("tools", "functions"):
        if body.get(key):
            raise bad(f"{key}: tool calling is not supported", key)
    add_gen = _opt_bool(body, "add_generation_prompt", True)
    codec = _need_codec(model, "messages")
    try:
        ids = chat_ids(codec, conv, add_generation_prompt=add_gen)
    except TemplateRenderError as exc:
        raise bad(f"messages: {exc}", "messages") from None
    if not ids:
        raise bad("messages render to no tokens", "messages")
    return ids


def parse_request(kind: str, body: Any, model: ModelText, served: str) -> GenRequest:
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", None)
    for key, value in body.items():
        _check_strings(value, key, key)
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad(f"model must be a string, got {_show(name)}", "model")
    if name not in (None, "", served):
        raise ApiError(404, f"the model {_show(name)} does not exist; this server serves "
                       f"{served!r}", "model", "not_found_error", "model_not_found")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad(f"n must be 1 (one choice per request), got {_show(n)}", "n")
    for key in ("best_of",):
        if body.get(key) not in (None, 1):
            raise bad(f"{key} must be 1, got {_show(body[key])}", key)
    if kind == "completion":
        if body.get("echo"):
            raise bad("echo is not supported", "echo")
        if body.get("suffix"):
            raise bad("suffix is not supported", "suffix")
    if body.get("logprobs") not in (None, False):
        raise bad("logprobs are not supported", "logprobs")
    stream = _opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        include_usage = _opt_bool(opts, "include_usage", False)
    temperature = _opt_number(body, "temperature", 1.0, 0.0, 2.0, False, "[0, 2]")
    top_p = _opt_number(body, "top_p", 1.0, 0.0, 1.0, True, "(0, 1]")
    top_k = _opt_int(body, "top_k", 0, -1, None, " (-1 or 0 = off, else >= 1)")
    seed = _opt_int(body, "seed", None, INT64[0], INT64[1], " in the signed 64-bit range")
    if seed is None:
        seed = secrets.randbits(63)
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif (isinstance(stop_raw, list) and len(stop_raw) <= MAX_STOP_STRINGS
          and all(isinstance(s, str) for s in stop_raw)):
        stop = list(stop_raw)
    else:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings, "
                  f"got {_show(stop_raw)}", "stop")
    stop = [s for s in stop if s]
    if stop:
        _need_codec(model, "stop")
    stop_ids_raw = body.get("stop_token_ids")
    if stop_ids_raw is None:
        stop_token_ids: list[int] = []
    else:
        checked = _ids(stop_ids_raw, model, "stop_token_ids")
        if checked is None:
            raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        stop_token_ids = checked
    ignore_eos = _opt_bool(body, "ignore_eos", False)

    if kind == "completion":
        prompt = _prompt_ids(body, model)
        prompt_param = "prompt"
    else:
        prompt = _chat_prompt(body, model)
        prompt_param = "messages"
    limit = model.max_model_len
    if len(prompt) >= limit:
        raise bad(f"{prompt_param}: the prompt is {len(prompt)} tokens; this model's maximum "
                  f"context length is {limit} tokens (prompt + completion)", prompt_param)
    key = "max_tokens"
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        key = "max_completion_tokens"
    default = 16 if kind == "completion" else limit - len(prompt)
    max_tokens = _opt_int(body, key, default, 1, None, " >= 1")
    assert max_tokens is not None
    if len(prompt) + max_tokens > limit:
        raise bad(f"{key}: this model's maximum context length is {limit} tokens; the request "
                  f"asks for {len(prompt) + max_tokens} ({len(prompt)} in the prompt, "
                  f"{max_tokens} for the completion)", key)
    local = set(stop_token_ids)
    if not ignore_eos:
        local |= model.eos_token_ids
    return GenRequest(
        kind=kind, prompt_ids=prompt, max_tokens=max_tokens,
        sampling={"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed},
        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, stream=stream,
        include_usage=include_usage, local_stop_ids=frozenset(local))


# ---------------------------------------------------------------- generation
class Output:
    """The completion as the client sees it: token ids, text, why it finished."""

    def __init__(self, req: GenRequest, model: ModelText) -> None:
        self.req = req
        self.detok = (IncrementalDetokenizer(model.codec, req.prompt_ids)
                      if model.codec is not None else None)
        self.stops = StopStrings(req.stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish: str | None = None

    @property
    def stopped_by_string(self) -> bool:
        return self.finish == "stop" and self.stops.hit

    def _emit(self, delta: str) -> str:
        out, hit = self.stops.feed(delta)
        if hit:
            self.finish = "stop"
        self.text += out
        return out

    def _tail(self) -> str:
        out = self._emit(self.detok.flush() if self.detok else "")
        if self.finish is None:
            held = self.stops.flush()
            self.text += held
            out += held
        return out

    def add(self, token: int) -> str:
        """Take one token; returns the text to show now. Sets `finish` when the request ends."""
        self.token_ids.append(token)
        if token in self.req.local_stop_ids:
            out = self._tail()
            self.finish = "stop"
            return out
        out = self._emit(self.detok.add(token) if self.detok else "")
        if self.finish is None and len(self.token_ids) >= self.req.max_tokens:
            out += self._tail()
            self.finish = self.finish or "length"
        return out

    def end(self, upstream_finish: Any) -> str:
        """The upstream finished before this side decided to (an instance-side stop)."""
        out = self._tail()
        if self.finish is None:
            self.finish = upstream_finish if upstream_finish in ("stop", "length") else (
                "stop" if self.token_ids and self.token_ids[-1] in self.req.local_stop_ids
                else "length")
        return out


@dataclass
class Trip:
    """Where one request went."""

    prefill: str | None = None
    decode: str | None = None
    transfer: Any = None
    finish: Any = None
    stamps: dict[str, float] = field(default_factory=dict)  # engine/timing.py's R_* names
    prefill_timing: Any = None
    decode_timing: Any = None

    def meta(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "transfer": self.transfer,
                "timing": timing.request_timing(self.stamps, self.prefill_timing,
                                                self.decode_timing)}


Emit = Callable[[list[int], str, str | None], Awaitable[None]]


def _upstream_error(role: str, url: str, status: int, data: Any,
                    headers: Mapping[str, str] | None = None) -> ApiError:
    """An instance's error, old (`{"error": "text"}`) or new (OpenAI-style) format."""
    err = data.get("error") if isinstance(data, dict) else None
    type_ = None
    if isinstance(err, dict):
        message = str(err.get("message", err))
        type_ = err.get("type") if isinstance(err.get("type"), str) else None
    elif isinstance(err, str):
        message = err
    else:
        message = str(data)[:500]
    out_headers = {}
    if status == 429 and headers and "Retry-After" in headers:
        out_headers["Retry-After"] = headers["Retry-After"]
    if status >= 500:
        message = f"{role} {url}: {message}"
    return ApiError(status, message, None, type_, None, out_headers)


# A replica's address that no longer answers (a pod just deleted) costs this much before the
# request goes to another replica.
CONNECT_TIMEOUT_S = 5.0
READY_POLL_S = 0.25


class _Unreachable(ApiError):
    """No connection: the replica never saw the request, so another may take it."""


class Router:
    def __init__(self, settings: RouterSettings, model: ModelText) -> None:
        self.settings = settings
        self.model = model
        self.prefill = Pool("prefill", settings.prefill, settings.prefill_service)
        self.decode = Pool("decode", settings.decode, settings.decode_service)
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.probe_session: aiohttp.ClientSession | None = None  # probes never queue behind work
        self.in_flight = 0
        self.created = int(time.time())
        self._background: set[asyncio.Task[None]] = set()
        self._probing: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        # The rule requests are routed by: a ready prefill with a ready decode of its plan.
        return self.prefill.pick(plans=self.decode.ready_plans()) is not None

    def check_capacity(self, req: GenRequest, key: str) -> None:
        """Refuse (400) what no instance could ever hold, before a prefill spends work on it:
        the prefill holds the prompt, the decode the prompt and every generated token but the
        last (which is never fed back)."""
        prompt = len(req.prompt_ids)
        prefill = self.prefill.largest_capacity()
        if prefill is not None and prompt > prefill:
            raise bad(f"prompt: the prompt is {prompt} tokens; the prefill instances hold at "
                      f"most {prefill} tokens of KV per sequence",
                      "prompt" if req.kind == "completion" else "messages")
        decode = self.decode.largest_capacity()
        need = prompt + req.max_tokens - 1
        if decode is not None and need > decode:
            raise bad(f"{key}: the decode instances hold at most {decode} tokens of KV per "
                      f"sequence; this request needs {need} ({prompt} in the prompt, "
                      f"{req.max_tokens} - 1 for the completion)", key)

    async def refresh(self) -> None:
        assert self.probe_session is not None
        # vLLM servers answer readiness on /health (pdd instances serve it too).
        path = "/health" if self.settings.upstream_protocol == "vllm" else "/readyz"
        for pool in (self.prefill, self.decode):
            pool.urls = await replicas(pool.static, pool.service)

            async def probe(url: str, pool: Pool = pool) -> None:
                try:
                    timeout = aiohttp.ClientTimeout(total=2)
                    async with self.probe_session.get(  # type: ignore[union-attr]
                            f"{url}{path}", timeout=timeout) as resp:
                        ok = resp.status == 200
                        body = await resp.json(content_type=None) if ok else None
                    if isinstance(body, dict) and isinstance(body.get("plan_digest"), str):
                        pool.plans[url] = body["plan_digest"]
                    if isinstance(body, dict) and type(body.get("kv_capacity_tokens")) is int:
                        pool.capacity[url] = body["kv_capacity_tokens"]
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                    ok = False
                if ok != pool.healthy.get(url):
                    log.info("%s replica %s is %s", pool.role, url, "ready" if ok else "not ready")
                pool.mark(url, ok)
                self.metrics.healthy.labels(role=pool.role, replica=url).set(1 if ok else 0)

            await asyncio.gather(*(probe(u) for u in pool.urls))

    async def probe_now(self) -> None:
        """One probe round now, shared by every request that asks while it runs."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.get_running_loop().create_task(self.refresh())
        try:
            await asyncio.shield(self._probing)
        except Exception as exc:  # the requests fall back on what the pools say
            log.warning("probe round failed: %s", exc)

    async def health_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # keep probing whatever happened
                log.warning("health probe round failed: %s", exc)
            await asyncio.sleep(self.settings.health_interval_s)

    async def _pick(self, pick: Callable[[set[str]], str | None],
                    tried: set[str]) -> str | None:
        """A ready replica not tried yet. When none is ready at all, what the last probe round
        saw may be a moment old (a pod just replaced during a roll, a probe that timed out
        under load): probe again, for up to `ready_wait_s`, before the caller refuses. When
        every ready replica was tried, refuse at once: waiting would not change their answer."""
        url = pick(tried)
        if url is not None:
            return url
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.ready_wait_s
        while True:
            await self.probe_now()
            url = pick(tried)
            if url is not None or pick(set()) is not None or loop.time() >= deadline:
                return url
            await asyncio.sleep(READY_POLL_S)

    async def _choose_prefill(self, tried: set[str]) -> str | None:
        # Only a prefill whose plan some ready decode runs: during a plan-changing roll the new
        # plan's prefill may be ready before its decode.
        return await self._pick(
            lambda skip: self.prefill.pick(skip, plans=self.decode.ready_plans()), tried)

    async def _choose_decode(self, plan: str | None, tried: set[str]) -> str | None:
        return await self._pick(lambda skip: self.decode.pick(skip, plan), tried)

    async def _post(self, role: str, url: str, path: str, body: dict[str, Any],
                    headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s or None,
                                            sock_connect=CONNECT_TIMEOUT_S)
            async with self.session.post(f"{url}{path}", json=body, headers=headers,
                                         timeout=timeout) as resp:
                try:
                    data = await resp.json(content_type=None)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    data = None
                if resp.status != 200:
                    raise _upstream_error(role, url, resp.status, data, resp.headers)
                if not isinstance(data, dict):
                    raise ApiError(502, f"{role} {url}{path}: answered 200 without a JSON object")
                return data
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ApiError(502, f"{role} {url}{path}: {type(exc).__name__}: {exc}") from None

    async def run_prefill(self, rid: str, body: dict[str, Any],
                          trip: Trip) -> tuple[str, dict[str, Any]]:
        tried: set[str] = set()
        last: ApiError | None = None
        while True:
            url = await self._choose_prefill(tried)
            if url is None:
                raise last or ApiError(503, "no ready prefill replica with a ready decode of "
                                       "its routing plan", type_="server_error")
            tried.add(url)
            trip.prefill = url
            trip.stamps[timing.R_PREFILL_SENT] = time.monotonic()
            try:
                return url, await self._post("prefill", url, "/v1/prefill", body)
            except ApiError as exc:
                if exc.status < 500:
                    raise
                log.warning("prefill replica failed, trying another: %s", exc)
                if exc.status == 502:  # unreachable: skip it until the next probe says ready
                    self.prefill.mark(url, False)
                last = exc

    async def release(self, prefill_url: str, rid: str, grant: Any) -> None:
        """Give held blocks back early; the grant proves they were handed to this request.
        Without one (the client left during the prefill) the prefill cancels the request
        itself when the connection drops, and its lease covers the rest."""
        if isinstance(grant, dict) and isinstance(grant.get("pdd_grant"), dict):
            grant = grant["pdd_grant"]  # vLLM's names around pdd's own grant
        if not isinstance(grant, dict):
            return
        try:
            await self._post("prefill", prefill_url, "/v1/release",
                             {"request_id": rid, "kv_transfer_params": grant})
        except ApiError as exc:
            log.info("release of %s on %s failed (the lease will free it): %s", rid,
                     prefill_url, exc)

    def release_soon(self, prefill_url: str, rid: str, grant: Any = None) -> None:
        """Release on its own task: the caller may be a handler being cancelled."""
        task = asyncio.get_running_loop().create_task(self.release(prefill_url, rid, grant))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _open_decode(self, rid: str, first: int, pre: dict[str, Any], req: GenRequest,
                           trip: Trip) -> aiohttp.ClientResponse:
        assert self.session is not None
        plan = self.prefill.plans.get(trip.prefill or "")
        tried: set[str] = set()
        while True:
            url = await self._choose_decode(plan, tried)
            if url is None:
                raise ApiError(503, "no ready decode replica"
                               + (f" running routing plan {plan}" if plan else ""),
                               type_="server_error")
            tried.add(url)
            try:
                return await self._open_decode_on(url, rid, first, pre, req, trip)
            except ApiError as exc:
                # Another decode may take what this one did not start: an incompatible one
                # (409), one not ready or draining before its exit (503), one not reachable.
                if exc.status not in (409, 503) and not isinstance(exc, _Unreachable):
                    raise
                if exc.status != 409:
                    self.decode.mark(url, False)  # until the next probe says ready
                log.warning("decode replica refused the hand-off, trying another: %s", exc)

    async def _open_decode_on(self, url: str, rid: str, first: int, pre: dict[str, Any],
                              req: GenRequest, trip: Trip) -> aiohttp.ClientResponse:
        assert self.session is not None
        trip.decode = url
        body = {"request_id": rid, "first_token": first, "max_new_tokens": req.max_tokens - 1,
                "kv_transfer_params": pre.get("kv_transfer_params"), "sampling": req.sampling,
                "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
                "stream": True}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=self.settings.request_timeout_s or None)
        trip.stamps[timing.R_DECODE_SENT] = time.monotonic()
        try:
            resp = await self.session.post(f"{url}/v1/decode", json=body, timeout=timeout)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
                aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            # No answer began: the connection failed, or the replica went away with it (a
            # draining decode exits once it answers nothing; it never took this request).
            raise _Unreachable(502, f"decode {url}/v1/decode: {type(exc).__name__}: {exc}"
                               ) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ApiError(502, f"decode {url}/v1/decode: {type(exc).__name__}: {exc}") from None
        if resp.status != 200:
            try:
                data = await resp.json(content_type=None)
            except (json.JSONDecodeError, UnicodeDecodeError, aiohttp.ClientError):
                data = None
            finally:
                resp.release()
            raise _upstream_error("decode", url, resp.status, data, resp.headers)
        return resp

    async def _tokens_vllm(self, rid: str, req: GenRequest,
                           trip: Trip) -> AsyncGenerator[int, None]:
        """vLLM's proxy flow to the upstreams (`PDD_ROUTER_UPSTREAM_PROTOCOL=vllm`): the
        prefill gets the request with max_tokens 1 and do_remote_decode, the decode gets the
        original request with the returned kv_transfer_params, one X-Request-Id for both; the
        completion is what the decode streams."""
        assert self.session is not None
        common = {"prompt": req.prompt_ids, **{k: v for k, v in req.sampling.items()
                                               if v is not None},
                  "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
                  "return_token_ids": True}
        headers = {"X-Request-Id": rid}
        url = await self._choose_prefill(set())
        if url is None:
            raise ApiError(503, "no ready prefill replica", type_="server_error")
        trip.prefill = url
        pre = await self._post("prefill", url, "/v1/completions", {
            **common, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}}, headers)
        params = pre.get("kv_transfer_params")
        try:
            choice = pre["choices"][0]
            first = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            self.release_soon(url, rid, params)
            raise ApiError(502, f"prefill {url}: answer without choices[0].token_ids") from None
        if req.max_tokens == 1 or not isinstance(params, dict):
            self.release_soon(url, rid, params)
            trip.finish = choice.get("finish_reason") or "length"
            for t in first:
                yield t
            return
        decode = await self._choose_decode(self.prefill.plans.get(url), set())
        if decode is None:
            self.release_soon(url, rid, params)
            raise ApiError(503, "no ready decode replica", type_="server_error")
        trip.decode = decode
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                        sock_read=self.settings.request_timeout_s or None)
        complete = False
        try:
            async with self.session.post(
                    f"{decode}/v1/completions", headers=headers, timeout=timeout,
                    json={**common, "max_tokens": req.max_tokens, "stream": True,
                          "kv_transfer_params": params}) as resp:
                if resp.status != 200:
                    data = await resp.json(content_type=None)
                    raise _upstream_error("decode", decode, resp.status, data, resp.headers)
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.strip() == b"data: [DONE]":
                        complete = True
                        return
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        raise _upstream_error("decode", decode, 502, msg)
                    choice = msg["choices"][0]
                    for t in choice.get("token_ids") or []:
                        yield int(t)
                    if choice.get("finish_reason"):
                        trip.finish = choice["finish_reason"]
            raise ApiError(502, f"decode {decode}: stream ended without [DONE]")
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError,
                TypeError) as exc:
            raise ApiError(502, f"decode {decode}: {type(exc).__name__}: {exc}") from None
        finally:
            if not complete:
                self.release_soon(url, rid, params)

    async def tokens(self, rid: str, req: GenRequest, trip: Trip) -> AsyncGenerator[int, None]:
        """The completion's tokens as the replicas choose them.

        Closing this generator early (a stop string, a client gone) closes the decode stream,
        which cancels the sequence there, and releases the prefill's blocks.
        """
        if self.settings.upstream_protocol == "vllm":
            inner = self._tokens_vllm(rid, req, trip)
            try:
                async for token in inner:
                    yield token
            finally:
                await inner.aclose()
            return
        prefill_body = {"request_id": rid, "prompt_ids": req.prompt_ids,
                        "max_tokens": req.max_tokens, "sampling": req.sampling,
                        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos}
        try:
            prefill_url, pre = await self.run_prefill(rid, prefill_body, trip)
            trip.stamps[timing.R_PREFILL_GOT] = time.monotonic()
            trip.prefill_timing = pre.get("timing")
        except asyncio.CancelledError:
            # The client left while the prefill ran: it may hold blocks for this id by now.
            if trip.prefill is not None:
                self.release_soon(trip.prefill, rid)
            raise
        if not _is_int(pre.get("first_token")):
            self.release_soon(prefill_url, rid, pre.get("kv_transfer_params"))
            raise ApiError(502, f"prefill {prefill_url}: answer without a first_token")
        first = int(pre["first_token"])
        # Pre-v2 prefills send no finish_reason and hold the blocks until released or read.
        finished = pre.get("finish_reason")
        held = finished is None
        resp: aiohttp.ClientResponse | None = None
        complete = False
        try:
            if finished is None and req.max_tokens > 1 and first not in req.local_stop_ids:
                resp = await self._open_decode(rid, first, pre, req, trip)
            yield first
            if resp is None:
                trip.finish = finished
                return
            while True:
                try:
                    line = await resp.content.readline()
                except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                    raise ApiError(502, f"decode {trip.decode}: stream broke: "
                                   f"{type(exc).__name__}: {exc}") from None
                if not line:
                    raise ApiError(502, f"decode {trip.decode}: stream ended without its "
                                   "final line")
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    msg = None
                if not isinstance(msg, dict) or ("token" in msg and not _is_int(msg["token"])):
                    raise ApiError(502, f"decode {trip.decode}: bad stream line "
                                   f"{line[:200]!r}")
                if "timing" in msg:
                    trip.decode_timing = msg["timing"]
                if "token" in msg:
                    yield int(msg["token"])
                elif "error" in msg:
                    status = msg.get("status")
                    if not isinstance(status, int) or isinstance(status, bool):
                        status = 502
                    raise _upstream_error("decode", str(trip.decode), status, msg)
                else:
                    complete = True
                    held = False
                    trip.finish = msg.get("finish_reason")
                    trip.transfer = msg.get("transfer")
                    return
        finally:
            if resp is not None:
                if complete:
                    resp.release()
                else:
                    resp.close()
            if held:
                self.release_soon(prefill_url, rid, pre.get("kv_transfer_params"))

    async def generate(self, rid: str, req: GenRequest, trip: Trip,
                       emit: Emit | None) -> Output:
        """Run one request; `emit(token_ids, text, finish_reason)` sees each step."""
        out = Output(req, self.model)
        upstream = self.tokens(rid, req, trip)
        start = time.monotonic()
        first_at: float | None = None
        count = 0
        try:
            async for token in upstream:
                if out.finish is not None:
                    break  # the instance goes on past this side's stop (pre-v2 instances do)
                count += 1
                if first_at is None:
                    first_at = time.monotonic()
                    self.metrics.ttft_seconds.observe(first_at - start)
                    trip.stamps[timing.R_FIRST_TOKEN] = first_at
                text = out.add(token)
                if emit is not None:
                    await emit([token], text, out.finish)
                if out.stopped_by_string:
                    break
            else:
                if out.finish is None:
                    text = out.end(trip.finish)
                    if emit is not None:
                        await emit([], text, out.finish)
        finally:
            await upstream.aclose()
            if first_at is not None and count > 1:
                self.metrics.tpot_seconds.observe((time.monotonic() - first_at) / (count - 1))
        return out


ROUTER = web.AppKey("router", Router)


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


def _usage(req: GenRequest, out: Output) -> dict[str, int]:
    n = len(out.token_ids)
    return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
            "total_tokens": len(req.prompt_ids) + n}


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    router = request.app[ROUTER]
    start = time.monotonic()
    outcome = "error"
    try:
        body = await _read_body(request)
        # Off the event loop: tokenizing a long text or rendering a template takes a while,
        # and the streams of other requests should not wait for it.
        req = await asyncio.to_thread(parse_request, kind, body, router.model,
                                      router.settings.model_name)
        router.check_capacity(req, "max_completion_tokens" if kind == "chat"
                              and body.get("max_completion_tokens") is not None
                              else "max_tokens")
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        trip = Trip()
        trip.stamps[timing.R_RECEIVED] = start
        if req.stream:
            response = await _stream(request, router, rid, req, trip)
        else:
            out = await router.generate(rid, req, trip, None)
            response = web.json_response(_final_body(router, rid, req, out, trip))
        outcome = "ok"
        return response
    except ApiError as exc:
        return exc.response()
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "cancelled"
        raise
    finally:
        router.metrics.requests.labels(outcome=outcome).inc()
        router.metrics.request_seconds.observe(time.monotonic() - start)


def _final_body(router: Router, rid: str, req: GenRequest, out: Output,
                trip: Trip) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0}
    if req.kind == "completion":
        choice.update(text=out.text)
    else:
        choice.update(message={"role": "assistant", "content": out.text})
    choice.update(token_ids=out.token_ids, logprobs=None, finish_reason=out.finish)
    return {"id": rid, "object": "text_completion" if req.kind == "completion"
            else "chat.completion", "created": int(time.time()),
            "model": router.settings.model_name, "choices": [choice], "usage": _usage(req, out),
            "pdd": trip.meta()}


async def _stream(request: web.Request, router: Router, rid: str, req: GenRequest,
                  trip: Trip) -> web.StreamResponse:
    """Server-sent events in OpenAI's chunk formats, then `data: [DONE]`.

    The response starts once the prefill answered, so errors before the first token keep
    their HTTP status; later ones arrive as an `{"error": ...}` event.
    """
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    created = int(time.time())
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    sent = {"tokens": 0}

    async def event(data: dict[str, Any] | str) -> None:
        payload = data if isinstance(data, str) else json.dumps(data)
        await response.write(f"data: {payload}\n\n".encode())

    def chunk(choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        body = {"id": rid, "object": obj, "created": created,
                "model": router.settings.model_name, "choices": [choice]}
        if req.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    async def emit(tokens: list[int], text: str, finish: str | None) -> None:
        if not response.prepared:
            await response.prepare(request)
            if req.kind == "chat":
                await event(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "token_ids": [], "logprobs": None, "finish_reason": None}))
        sent["tokens"] += len(tokens)
        if req.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text}
        else:
            choice = {"index": 0, "delta": {"content": text} if text or not finish else {}}
        choice.update(token_ids=tokens, logprobs=None, finish_reason=finish)
        extra = {"pdd": trip.meta()} if finish else {}
        await event(chunk(choice, **extra))

    try:
        out = await router.generate(rid, req, trip, emit)
    except ApiError as exc:
        if not response.prepared:
            raise
        await event(exc.body())
        await event("[DONE]")
        await response.write_eof()
        return response
    if req.include_usage:
        body = {"id": rid, "object": obj, "created": created,
                "model": router.settings.model_name, "choices": [], "usage": _usage(req, out)}
        await event(body)
    await event("[DONE]")
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


def _model_card(router: Router) -> dict[str, Any]:
    return {"id": router.settings.model_name, "object": "model", "created": router.created,
            "owned_by": "pdd", "root": router.model.source,
            "max_model_len": router.model.max_model_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[ROUTER])]})


async def model_card(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    name = request.match_info["name"]
    if name != router.settings.model_name:
        return ApiError(404, f"the model {_show(name)} does not exist; this server serves "
                        f"{router.settings.model_name!r}", "model", "not_found_error",
                        "model_not_found").response()
    return web.json_response(_model_card(router))


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
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[openai_errors])
    app[ROUTER] = router
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
            connector=fresh_dns_connector(limit=2 * settings.max_concurrency),
        )
        router.probe_session = aiohttp.ClientSession(connector=fresh_dns_connector())
        await router.refresh()
        task = asyncio.create_task(router.health_loop())
        yield
        task.cancel()
        await router.session.close()
        await router.probe_session.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def main(env: Mapping[str, str] | None = None) -> int:
    try:
        settings = RouterSettings.from_env(env)
        model = load_model_text(settings.model_source, settings.max_model_len or None)
    except (ConfigError, TextConfigError) as exc:
        print(f"pdd-router: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=os.environ.get("PDD_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s router %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    log.info("router on %s:%d serving %s (%s, max length %d); prefill %s %s; decode %s %s",
             settings.bind_host, settings.port, settings.model_name, model.source,
             model.max_model_len, settings.prefill, settings.prefill_service, settings.decode,
             settings.decode_service)
    # handler_cancellation: a client that goes away cancels its handler at once, which closes
    # the decode stream and releases the prefill (see Router.tokens).
    web.run_app(build_app(settings, model), host=settings.bind_host, port=settings.port,
                print=None, access_log=None, handler_cancellation=True)
    return 0
