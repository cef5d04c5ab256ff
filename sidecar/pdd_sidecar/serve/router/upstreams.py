"""The router's side of the hand-off: its prefill and decode replicas, their health probes, and
the client that runs one request on a prefill and hands its KV to a decode.

A prefill replica is chosen among the ready ones whose routing plan some ready decode runs, a
decode among the ready ones of the prefill's plan, each by the routing policy
(serve/router/routing_policy.py: by prompt prefix and load by default); a 5xx or unreachable replica
is retried on another, a 4xx is the client's answer.
The decode's tokens are always read as a stream: closing it (a stop string, a client gone)
cancels the sequence there, and the prefill gets a /v1/release.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from opentelemetry.context import Context

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.env import RouterSettings
from pdd_sidecar.metrics import RouterMetrics
from pdd_sidecar.serve.discovery import replicas
from pdd_sidecar.serve.openai.completion_output import Output
from pdd_sidecar.serve.openai.logprob_format import entry_ok
from pdd_sidecar.serve.openai.openai_request import ApiError, GenRequest, bad, is_int
from pdd_sidecar.serve.openai.structured_request import STRUCTURED, structured_outputs
from pdd_sidecar.serve.openai.text import ModelText
from pdd_sidecar.serve.router.connection_warmer import WARM_CONNECTIONS, ConnectionWarmer
from pdd_sidecar.serve.router.prefill_path import (
    FALLBACK,
    LOCAL,
    REMOTE,
    prefill_path,
    uncached_tokens,
)
from pdd_sidecar.serve.router.replica_pool import Pool
from pdd_sidecar.serve.router.router_warmup import WARMUP_MAX_TOKENS, WarmRoundTrip, warmup_prompt
from pdd_sidecar.serve.router.router_workers import mark_warm, warm_workers
from pdd_sidecar.serve.router.routing_policy import make_policy
from pdd_sidecar.serve.router.spans import record_decision
from pdd_sidecar.serve.router.upstream_http import (
    CONNECT_TIMEOUT_S,
    Unreachable,
    post_json,
    upstream_error,
)

log = logging.getLogger(__name__)

READY_POLL_S = 0.25


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
    cached_tokens: int = 0  # prompt tokens the prefill took from its prefix cache
    # the decision's estimate of the prompt's tokens each decode that prefills caches (choose_path)
    local_cache: dict[str, int] = field(default_factory=dict)
    # Log-probability entries (serve/openai/logprob_format.py): each choice's, one per token handed
    # out, in order; the prompt's (computed once, whatever n), from its second token on.
    logprobs: dict[int, list[Any]] = field(default_factory=lambda: defaultdict(list))
    prompt_logprobs: list[Any] = field(default_factory=list)
    finishes: dict[int, Any] = field(default_factory=dict)  # n > 1: each choice's, the decode's
    # The request's trace context (its span in the router; serve/router/spans.py), None when
    # neither tracing nor the client asked for one; and the hand-offs tried (decodes sent to).
    trace: Context | None = None
    handoffs: int = 0
    output_tokens: int = 0  # handed to the client so far, every choice
    path: str | None = None  # where the prompt was prefilled (serve/router/prefill_path.py)
    warmup: bool = False  # the warm round trip: through a prefill whenever one is ready

    def exemplar(self) -> dict[str, str] | None:
        """The trace id of a sampled request, for its TTFT's exemplar (a link to its trace)."""
        if self.trace is None:
            return None
        tid = tracing.sampled_trace_id(self.trace)
        return {"trace_id": tid} if tid is not None else None

    def trace_headers(self) -> dict[str, str]:
        """The W3C trace context for a call to an instance (none without a trace)."""
        headers: dict[str, str] = {}
        if self.trace is not None:
            tracing.inject(headers, self.trace)
        return headers

    def meta(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "path": self.path,
                "transfer": self.transfer,
                "timing": timing.request_timing(self.stamps, self.prefill_timing,
                                                self.decode_timing)}


def _cached_tokens(holder: Any) -> int:
    """``cached_tokens`` of an upstream answer; 0 from one that predates the prefix cache."""
    n = holder.get("cached_tokens") if isinstance(holder, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0


# One step of a completion: (token ids, text to show, finish reason).
Step = tuple[list[int], str, str | None]
Emit = Callable[[int, list[Step]], Awaitable[None]]  # (choice index, its steps)
Batch = tuple[int, list[int]]  # a choice's index and tokens of it that arrived together


def _retryable(exc: ApiError) -> bool:
    """An upstream's refusal that another upstream may not give (full, not ready, gone)."""
    return exc.status >= 500 or exc.status == 429


def _refused(exc: ApiError) -> bool:
    """A decode did not take the request (``_open_decode``'s own test): incompatible, full,
    not ready or draining, or not reachable. Its other errors are answers."""
    return exc.status in (409, 429, 503) or isinstance(exc, Unreachable)


def _token_line(line: bytes) -> int | None:
    """The id of a decode's ``{"token": id}`` line as json.dumps writes it (all but the first
    and last line of a stream), without the JSON decoder; None for any other line."""
    if line.startswith(b'{"token": ') and line.endswith(b"}"):
        digits = line[10:-1]
        if digits.isdigit() and len(digits) < 12:
            return int(digits)
    return None


def _take_logprobs(req: GenRequest, pre: dict[str, Any], url: str, trip: Trip) -> None:
    """The prefill's log-probabilities of the first token and the prompt, checked."""
    if req.logprobs is not None:
        got = pre.get("logprobs")
        if not (isinstance(got, list) and len(got) == req.n and all(entry_ok(e) for e in got)):
            raise ApiError(502, f"prefill {url}: answer without the first token's "
                           "log-probabilities" + ("" if req.n == 1 else " of every choice"))
        for j, entry in enumerate(got):
            trip.logprobs[j].append(entry)
    if req.prompt_logprobs is not None:
        got = pre.get("prompt_logprobs")
        if not (isinstance(got, list) and len(got) == len(req.prompt_ids) - 1
                and all(entry_ok(e) for e in got)):
            raise ApiError(502, f"prefill {url}: answer without the prompt's "
                           "log-probabilities")
        trip.prompt_logprobs = got


def _choice_token_line(line: bytes) -> tuple[int, int] | None:
    """``(choice, id)`` of a decode's ``{"choice": j, "token": id}`` line (n > 1), as
    ``_token_line`` reads its own."""
    if line.startswith(b'{"choice": ') and line.endswith(b"}"):
        head, sep, tail = line[11:-1].partition(b', "token": ')
        if sep and head.isdigit() and tail.isdigit() and len(tail) < 12 and len(head) < 4:
            return int(head), int(tail)
    return None


def _first_tokens(pre: dict[str, Any], n: int) -> list[int] | None:
    """Each choice's first token from a prefill's answer (``first_tokens`` when n > 1)."""
    if n == 1:
        return [int(pre["first_token"])] if is_int(pre.get("first_token")) else None
    firsts = pre.get("first_tokens")
    if isinstance(firsts, list) and len(firsts) == n and all(is_int(t) for t in firsts):
        return [int(t) for t in firsts]
    return None


def _choice_finishes(msg: dict[str, Any]) -> dict[int, Any]:
    """Each choice's finish reason from a decode's final line (n > 1)."""
    out: dict[int, Any] = {}
    for c in msg.get("choices") or ():
        if isinstance(c, dict) and is_int(c.get("index")):
            out[int(c["index"])] = c.get("finish_reason")
    return out


class PrefillLost(Exception):
    """The decode could not read the KV a prefill holds (the prefill is gone or its READ
    broke) before any token reached the client."""

    def __init__(self, url: str, error: ApiError) -> None:
        super().__init__(str(error))
        self.url = url
        self.error = error


def served_max_model_len(model_limit: int, prefill_tokens: int | None,
                         decode_tokens: int | None) -> int:
    """The longest prompt + completion that is served whatever its split: the checkpoint's
    limit (or PDD_MAX_MODEL_LEN), and what the ready instances hold (None: not known yet). A
    prefill holds the prompt, at most one token shorter than the whole; a decode the prompt and
    every generated token but the last, which is never fed back: so each holds one token less
    than the length it serves."""
    limit = model_limit
    for held in (prefill_tokens, decode_tokens):
        if held is not None:
            limit = min(limit, held + 1)
    return limit


class Router:
    def __init__(self, settings: RouterSettings, model: ModelText) -> None:
        self.settings = settings
        self.model = model
        shared = settings.workers > 1
        self.prefill = Pool("prefill", settings.prefill, settings.prefill_service,
                            make_policy(settings.router_policy, settings.block_size, shared))
        self.decode = Pool("decode", settings.decode, settings.decode_service,
                           make_policy(settings.router_policy, settings.block_size, shared))
        self.metrics = RouterMetrics()
        self.metrics.local_prefill_tokens.set(settings.local_prefill_tokens)
        self.session: aiohttp.ClientSession | None = None
        self.probe_session: aiohttp.ClientSession | None = None  # probes never queue behind work
        self.in_flight = 0
        self.created = int(time.time())
        self._background: set[asyncio.Task[None]] = set()
        self._probing: asyncio.Task[None] | None = None
        self.warm = WarmRoundTrip()
        # Idle connections to each ready instance for bursts (pdd instances only: a vLLM
        # server's keep-alive may be shorter than the pool's).
        self.warmer = (ConnectionWarmer(min(WARM_CONNECTIONS, settings.max_concurrency))
                       if settings.upstream_protocol == "pdd" else None)
        self._all_warm = False  # once every worker is warm it stays so (one dying stops all)
        self._served_len = model.max_model_len  # last logged by refresh

    @property
    def pools_ready(self) -> bool:
        # The rule requests are routed by: a ready prefill with a ready decode of its plan.
        return bool(self.prefill.candidates(plans=self.decode.ready_plans()))

    @property
    def routable(self) -> bool:
        """Requests can be served: through a prefill, or on a decode while none is ready and
        the fallback is on (serve/router/prefill_path.py)."""
        s = self.settings
        return self.pools_ready or ((s.aggregated or s.no_prefill == "fallback")
                                    and bool(self.decode.local_candidates()))

    @property
    def warmable(self) -> bool:
        """The warm round trip can run: through a prefill, or on a decode when there is no
        prefill at all (aggregated)."""
        return self.pools_ready or (self.settings.aggregated
                                    and bool(self.decode.local_candidates()))

    @property
    def ready(self) -> bool:
        """Routable, and one round trip has run (serve/router/router_warmup.py), in every worker.
        The round trip runs through a prefill: a router is first ready only once the hand-off
        worked; later, with no prefill ready, the fallback keeps it serving."""
        return self.warm.done and self.routable and self.workers_warm == self.settings.workers

    def _decode_can(self, req: GenRequest) -> bool:
        """A decode that prefills prompts is ready, and this is a request it can prefill."""
        return (req.n == 1 and req.prompt_logprobs is None and req.max_tokens > 0
                and bool(self.decode.local_candidates()))

    def _can_fall_back(self, req: GenRequest, trip: Trip) -> bool:
        """Served on a decode if no prefill is (the warm round trip must go through one)."""
        return (not trip.warmup and self.settings.no_prefill == "fallback"
                and self._decode_can(req))

    def _count_path(self, trip: Trip, path: str) -> None:
        """Where the request was served, counted once it was taken there (not the warm round
        trip's)."""
        trip.path = path
        if not trip.warmup:
            self.metrics.paths.labels(path=path).inc()

    def choose_path(self, req: GenRequest, trip: Trip) -> str | None:
        """Where this request's prompt is prefilled; None: through a prefill, refused if none
        becomes ready (serve/router/prefill_path.py)."""
        s = self.settings
        ready = self.pools_ready
        if trip.warmup and ready:
            return REMOTE
        decode_can = self._decode_can(req)
        if s.aggregated:  # no prefill at all: every prompt runs on its decode
            return LOCAL if decode_can else None
        trip.local_cache = (self.decode.cached_by(req.prompt_ids)
                            if ready and decode_can and s.local_prefill_tokens else {})
        return prefill_path(len(req.prompt_ids), max(trip.local_cache.values(), default=0),
                            s.local_prefill_tokens, ready, s.no_prefill, decode_can)

    @property
    def workers_warm(self) -> int:
        """The router's workers whose warm round trip came back (this one alone: 1 or 0)."""
        s = self.settings
        if s.worker is None or not s.workers_dir:
            return int(self.warm.done)
        if self._all_warm:
            return s.workers
        warm = warm_workers(s.workers_dir, s.workers)
        self._all_warm = warm == s.workers
        return warm

    def _warmed(self, seconds: float) -> None:
        self.metrics.warmup_seconds.set(seconds)
        s = self.settings
        if s.worker is not None and s.workers_dir:
            mark_warm(s.workers_dir, s.worker)

    def warmup_request(self) -> GenRequest:
        return GenRequest(kind="completion", prompt_ids=warmup_prompt(self.model.vocab_size),
                          max_tokens=WARMUP_MAX_TOKENS, sampling={"temperature": 0.0, "seed": 0},
                          stop=[], stop_token_ids=[], ignore_eos=True, stream=False,
                          include_usage=False)

    def max_model_len(self) -> int:
        """What /v1/models reports: ``served_max_model_len`` over the ready replicas (the
        largest of each role, as ``check_capacity`` judges a request)."""
        return served_max_model_len(self.model.max_model_len, self.prefill.largest_capacity(),
                                    self.decode.largest_capacity())

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
            pool.prune()

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
                    if isinstance(body, dict) and isinstance(body.get("load"), dict):
                        pool.report(url, body["load"])
                    if isinstance(body, dict) and body.get("local_prefill") is True:
                        pool.local_prefill.add(url)
                    elif ok:
                        pool.local_prefill.discard(url)
                    unit = body.get("cache_unit_tokens") if isinstance(body, dict) else None
                    if type(unit) is int and unit > 0:
                        pool.cache_unit[url] = unit
                except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                    ok = False
                if ok != pool.healthy.get(url):
                    log.info("%s replica %s is %s", pool.role, url, "ready" if ok else "not ready")
                pool.mark(url, ok)
                self.metrics.healthy.labels(role=pool.role, replica=url).set(1 if ok else 0)

            await asyncio.gather(*(probe(u) for u in pool.urls))
        served = self.max_model_len()
        if served != self._served_len:
            log.info("serving max_model_len %d (the model's %d; KV tokens a sequence can hold "
                     "on the largest ready prefill %s, decode %s)", served,
                     self.model.max_model_len, self.prefill.largest_capacity(),
                     self.decode.largest_capacity())
            self._served_len = served
        self.warm.ensure(self, self.warmup_request, lambda: Trip(warmup=True), self._warmed)
        if self.warmer is not None:
            self.warmer.ensure(self.session, [u for pool in (self.prefill, self.decode)
                                              for u in pool.urls if pool.healthy.get(u)])

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
                # Shared with the requests' own rounds: two rounds at once would let the older
                # one's late answer overwrite the newer's.
                await self.probe_now()
            except Exception as exc:  # keep probing whatever happened
                log.warning("health probe round failed: %s", exc)
            self.metrics.gc_pauses.flush()  # a scrape may reach another worker
            await asyncio.sleep(self.settings.health_interval_s)

    async def _pick(self, pick: Callable[[set[str]], str | None],
                    tried: set[str], wait: bool = True) -> str | None:
        """A ready replica not tried yet. When none is ready at all, what the last probe round
        saw may be a moment old (a pod just replaced during a roll, a probe that timed out
        under load): probe again, for up to `ready_wait_s`, before the caller refuses (unless
        ``wait`` is False: the caller has somewhere else to go). When every ready replica was
        tried, refuse at once: waiting would not change their answer."""
        url = pick(tried)
        if url is not None or not wait:
            return url
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.ready_wait_s
        while True:
            await self.probe_now()
            url = pick(tried)
            if url is not None or pick(set()) is not None or loop.time() >= deadline:
                return url
            await asyncio.sleep(READY_POLL_S)

    async def _choose_prefill(self, tried: set[str], prompt_ids: list[int] | None = None,
                              wait: bool = True) -> str | None:
        # Only a prefill whose plan some ready decode runs: during a plan-changing roll the new
        # plan's prefill may be ready before its decode.
        return await self._pick(
            lambda skip: self.prefill.pick(skip, plans=self.decode.ready_plans(),
                                           prompt_ids=prompt_ids), tried, wait)

    async def _choose_decode(self, plan: str | None, tried: set[str],
                             prompt_ids: list[int] | None = None,
                             allowed: Callable[[str], bool] | None = None,
                             wait: bool = True) -> str | None:
        """``allowed``: only decodes it says yes to, judged at each pick (a probe round may
        list new ones)."""
        # With the prompt: the decode that served the conversation so far most likely still
        # caches its KV (routing_policy.py), and then pulls only the new tokens'.
        def pick(skip: set[str]) -> str | None:
            if allowed is not None:
                skip = skip | {u for u in self.decode.urls if not allowed(u)}
            return self.decode.pick(skip, plan, prompt_ids=prompt_ids)

        return await self._pick(pick, tried, wait)

    async def _post(self, role: str, url: str, path: str, body: dict[str, Any],
                    headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        assert self.session is not None
        return await post_json(self.session, role, url, path, body,
                               self.settings.request_timeout_s or None, headers)

    async def run_prefill(self, rid: str, body: dict[str, Any], trip: Trip,
                          skip: set[str] | None = None,
                          wait: bool = True) -> tuple[str, dict[str, Any]]:
        """The first prefill not in ``skip`` that answers; each that failed with a 5xx is
        added to ``skip`` (a later try of the same request passes them over). ``wait``: see
        ``_pick``."""
        tried: set[str] = set(skip or ())
        last: ApiError | None = None
        prompt = body.get("prompt_ids")
        while True:
            picking = time.monotonic()
            url = await self._choose_prefill(tried, prompt, wait)
            if url is None:
                raise last or ApiError(503, "no ready prefill replica with a ready decode of "
                                       "its routing plan", type_="server_error")
            if trip.trace is not None:  # before the pool records the prompt there
                record_decision(trip.trace, self.prefill, url, self.prefill.candidates(
                    tried, plans=self.decode.ready_plans()), prompt, picking)
            tried.add(url)
            trip.prefill = url
            trip.stamps[timing.R_PREFILL_SENT] = time.monotonic()
            self.prefill.started(url, prompt)
            try:
                return url, await self._post("prefill", url, "/v1/prefill", body,
                                             trip.trace_headers() or None)
            except ApiError as exc:
                if exc.status < 500:
                    raise
                log.warning("prefill replica failed, trying another: %s", exc)
                if exc.status in (502, 503):  # unreachable, or not ready (draining, starting):
                    self.prefill.mark(url, False)  # skipped until the next probe says ready
                if skip is not None:
                    skip.add(url)
                last = exc
            finally:
                self.prefill.finished(url)

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

    async def end_choice(self, decode_url: str, rid: str, choice: int) -> None:
        """Tell the decode that one choice of several is over (this side's stop string): it
        stops generating what would be thrown away, and the request ends with its last choice
        instead of at this one's max_tokens. Best effort: a decode that does not know the call
        (an older one) or does not answer only costs those tokens."""
        try:
            await self._post("decode", decode_url, "/v1/decode/end",
                             {"request_id": rid, "choice": choice})
        except ApiError as exc:
            log.debug("ending choice %d of %s on %s: %s", choice, rid, decode_url, exc)

    def soon(self, work: Coroutine[Any, Any, None]) -> None:
        """Run on its own task: the caller may be a handler being cancelled."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def release_soon(self, prefill_url: str, rid: str, grant: Any = None) -> None:
        self.soon(self.release(prefill_url, rid, grant))

    async def _open_decode(self, rid: str, choices: list[tuple[int, int]],
                           pre: dict[str, Any] | None, req: GenRequest,
                           trip: Trip) -> aiohttp.ClientResponse:
        assert self.session is not None
        plan = self.prefill.plans.get(trip.prefill or "")
        tried: set[str] = set()
        allowed: Callable[[str], bool] | None = None
        wait = True
        if pre is None:
            # Prefilled on the decode: only one that says it does (an older one would refuse),
            # and for a request the decision sent there (LOCAL), one that caches enough of the
            # prompt; if none of those can take it, a prefill can (tokens()).
            short = trip.path == LOCAL and not self.settings.aggregated
            limit = self.settings.local_prefill_tokens
            # the decision's estimate (a decode that appeared since caches nothing)
            cached = trip.local_cache
            allowed = (lambda u: u in self.decode.local_prefill  # noqa: E731
                       and not (short and uncached_tokens(len(req.prompt_ids),
                                                          cached.get(u, 0)) > limit))
            wait = not (short and self.pools_ready)
        last: ApiError | None = None
        while True:
            picking = time.monotonic()
            url = await self._choose_decode(plan, tried, req.prompt_ids, allowed, wait)
            if url is None:
                raise last or ApiError(503, "no ready decode replica"
                                       + (f" running routing plan {plan}" if plan else ""),
                                       type_="server_error")
            if trip.trace is not None:
                record_decision(trip.trace, self.decode, url,
                                self.decode.candidates(tried, plan), req.prompt_ids, picking)
            tried.add(url)
            self.decode.started(url)  # until the stream ends (Router.tokens)
            opened = False
            try:
                resp = await self._open_decode_on(url, rid, choices, pre, req, trip)
                opened = True
                return resp
            except ApiError as exc:
                # Another decode may take what this one did not start: an incompatible one
                # (409), one with a full queue (429), one not ready or draining before its exit
                # (503), one not reachable.
                if not _refused(exc):
                    raise
                if exc.status not in (409, 429):
                    self.decode.mark(url, False)  # until the next probe says ready
                log.warning("decode replica refused the hand-off, trying another: %s", exc)
                last = exc
            finally:
                if not opened:
                    self.decode.finished(url)

    async def _open_decode_on(self, url: str, rid: str, choices: list[tuple[int, int]],
                              pre: dict[str, Any] | None, req: GenRequest, trip: Trip
                              ) -> aiohttp.ClientResponse:
        """``choices``: ``(index, first token)`` of each choice the decode runs (n > 1: those
        the first token did not end). ``pre`` None: the decode prefills the prompt itself."""
        assert self.session is not None
        trip.decode = url
        body: dict[str, Any] = {
                "request_id": rid, "max_new_tokens": req.max_tokens - 1,
                "prompt_ids": req.prompt_ids, "sampling": req.sampling,
                "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
                "stream": True}
        if req.logprobs is not None:
            body["logprobs"] = req.logprobs
        if pre is None:  # the decode prefills the prompt itself
            body["local_prefill"] = True
        elif req.n == 1:
            body["kv_transfer_params"] = pre.get("kv_transfer_params")
            body["first_token"] = choices[0][1]
        else:
            body["kv_transfer_params"] = pre.get("kv_transfer_params")
            body["choices"] = [list(c) for c in choices]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=self.settings.request_timeout_s or None)
        trip.stamps[timing.R_DECODE_SENT] = time.monotonic()
        trip.handoffs += 1
        headers = trip.trace_headers()
        if headers:
            headers[tracing.HANDOFF_ATTEMPT_HEADER] = str(trip.handoffs)
        try:
            resp = await self.session.post(f"{url}/v1/decode", json=body, timeout=timeout,
                                           headers=headers or None)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
                aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            # No answer began: the connection failed, or the replica went away with it (a
            # draining decode exits once it answers nothing; it never took this request).
            raise Unreachable(502, f"decode {url}/v1/decode: {type(exc).__name__}: {exc}"
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
            raise upstream_error("decode", url, resp.status, data, resp.headers)
        return resp

    async def _tokens_vllm(self, rid: str, req: GenRequest,
                           trip: Trip) -> AsyncGenerator[list[int], None]:
        """vLLM's proxy flow to the upstreams (`PDD_ROUTER_UPSTREAM_PROTOCOL=vllm`): the
        prefill gets the request with max_tokens 1 and do_remote_decode, the decode gets the
        original request with the returned kv_transfer_params, one X-Request-Id for both; the
        completion is what the decode streams."""
        assert self.session is not None
        common = {"prompt": req.prompt_ids, **{k: v for k, v in req.sampling.items()
                                               if v is not None and k != STRUCTURED},
                  "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
                  "return_token_ids": True}
        if req.sampling.get(STRUCTURED) is not None:
            common["structured_outputs"] = structured_outputs(req.sampling[STRUCTURED])
        # vLLM continues the trace where its own tracing is on (--otlp-traces-endpoint).
        headers = {"X-Request-Id": rid, **trip.trace_headers()}
        url = await self._choose_prefill(set(), req.prompt_ids)
        if url is None:
            raise ApiError(503, "no ready prefill replica", type_="server_error")
        trip.prefill = url
        self.prefill.started(url, req.prompt_ids)
        try:
            pre = await self._post("prefill", url, "/v1/completions", {
                **common, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}}, headers)
        finally:
            self.prefill.finished(url)
        params = pre.get("kv_transfer_params")
        usage = pre.get("usage")
        trip.cached_tokens = _cached_tokens(
            usage.get("prompt_tokens_details") if isinstance(usage, dict) else None)
        try:
            choice = pre["choices"][0]
            first = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            self.release_soon(url, rid, params)
            raise ApiError(502, f"prefill {url}: answer without choices[0].token_ids") from None
        if req.max_tokens == 1 or not isinstance(params, dict):
            self.release_soon(url, rid, params)
            trip.finish = choice.get("finish_reason") or "length"
            if first:
                yield first
            return
        decode = await self._choose_decode(self.prefill.plans.get(url), set())
        if decode is None:
            self.release_soon(url, rid, params)
            raise ApiError(503, "no ready decode replica", type_="server_error")
        trip.decode = decode
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                        sock_read=self.settings.request_timeout_s or None)
        complete = False
        self.decode.started(decode)
        try:
            async with self.session.post(
                    f"{decode}/v1/completions", headers=headers, timeout=timeout,
                    json={**common, "max_tokens": req.max_tokens, "stream": True,
                          "kv_transfer_params": params}) as resp:
                if resp.status != 200:
                    data = await resp.json(content_type=None)
                    raise upstream_error("decode", decode, resp.status, data, resp.headers)
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.strip() == b"data: [DONE]":
                        complete = True
                        return
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        raise upstream_error("decode", decode, 502, msg)
                    choice = msg["choices"][0]
                    ids = [int(t) for t in choice.get("token_ids") or []]
                    if ids:
                        yield ids
                    if choice.get("finish_reason"):
                        trip.finish = choice["finish_reason"]
            raise ApiError(502, f"decode {decode}: stream ended without [DONE]")
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError,
                TypeError) as exc:
            raise ApiError(502, f"decode {decode}: {type(exc).__name__}: {exc}") from None
        finally:
            self.decode.finished(decode)
            if not complete:
                self.release_soon(url, rid, params)

    async def tokens(self, rid: str, req: GenRequest,
                     trip: Trip) -> AsyncGenerator[Batch, None]:
        """The completion's tokens as the replicas choose them, in batches of what arrived
        together (one token each while the router keeps up), each with its choice's index
        (0 unless n > 1; the first token of every choice comes first, in order).

        Closing this generator early (a stop string, a client gone) closes the decode stream,
        which cancels the sequence there, and releases the prefill's blocks.
        """
        if self.settings.upstream_protocol == "vllm":
            if req.n > 1:
                raise bad("n: several choices need pdd's own upstream protocol (the router "
                          "runs with PDD_ROUTER_UPSTREAM_PROTOCOL=vllm)", "n")
            vllm = self._tokens_vllm(rid, req, trip)
            try:
                async for tokens in vllm:
                    trip.output_tokens += len(tokens)
                    yield 0, tokens
            finally:
                await vllm.aclose()
            return
        # A prefill that went away between its answer and the decode's claim (a pod replaced
        # during a roll) costs the request nothing the client sees: no decode token was sent
        # yet, so the prompt runs again on another prefill, while there is one, and the decode
        # is fed the first token the client already has.
        path = self.choose_path(req, trip)
        if path is None and self.settings.aggregated:
            field = ("n" if req.n > 1 else "prompt_logprobs" if req.prompt_logprobs is not None
                     else "max_tokens")
            raise bad(f"{field}: this deployment has no prefill instance, and a decode "
                      f"prefills only requests of one choice, without prompt log-probabilities, "
                      f"that generate at least one token", field)
        if path in (LOCAL, FALLBACK):
            started = False
            try:
                async for choice, batch in self._local_tokens(rid, req, trip, path):
                    started = True
                    yield choice, batch
                return
            except ApiError as exc:
                # No token reached the client: every decode that could prefill it refused
                # (draining, full, gone). A prefill serves it when one is ready.
                if started or path != LOCAL or not _refused(exc) or not self.pools_ready:
                    raise
                log.warning("no decode took request %s to prefill it itself, going through a "
                            "prefill: %s", rid, exc)
        skip: set[str] = set()
        firsts: dict[int, int] = {}  # each choice's first token, as the client has it
        sent_first: list[int] | None = None
        while True:
            inner = self._tokens_pdd(rid, req, trip, skip, sent_first,
                                     wait=not self._can_fall_back(req, trip))
            try:
                async for choice, batch in inner:
                    firsts.setdefault(choice, batch[0])
                    trip.output_tokens += len(batch)
                    yield choice, batch
                return
            except PrefillLost as lost:
                if self.prefill.pick(skip | {lost.url}, plans=self.decode.ready_plans()) is None:
                    raise lost.error from None
                skip.add(lost.url)
                sent_first = [firsts[j] for j in range(req.n)]
                log.warning("the hand-off from prefill %s failed before the decode's first "
                            "token; running the prompt again on another prefill: %s",
                            lost.url, lost.error)
            except ApiError as exc:
                # No prefill answered, and none is ready now: served on a decode, as a request
                # arriving now would be (with the fallback on).
                if (firsts or not _retryable(exc) or not self._can_fall_back(req, trip)
                        or self.choose_path(req, trip) != FALLBACK):
                    raise
                log.warning("request %s lost its prefill and none is ready; falling back to "
                            "a decode: %s", rid, exc)
                trip.prefill = None  # any decode may take it, whatever that prefill's plan
                break
            finally:
                await inner.aclose()
        async for choice, batch in self._local_tokens(rid, req, trip, FALLBACK):
            yield choice, batch

    async def _local_tokens(self, rid: str, req: GenRequest, trip: Trip,
                            path: str) -> AsyncGenerator[Batch, None]:
        """The request prefilled on its decode (``LOCAL`` or ``FALLBACK``)."""
        trip.path = path  # which decodes may take it (_open_decode); counted once one does
        local = self._tokens_pdd(rid, req, trip, set(), None, local=True)
        try:
            async for choice, batch in local:
                trip.output_tokens += len(batch)
                yield choice, batch
        finally:
            await local.aclose()

    async def _tokens_pdd(self, rid: str, req: GenRequest, trip: Trip, skip: set[str],
                          sent_first: list[int] | None, local: bool = False,
                          wait: bool = True) -> AsyncGenerator[Batch, None]:
        """One try of pdd's own flow: a prefill (not one in ``skip``), its token to the client
        at once (n > 1: each choice's), then the hand-off to a decode. On a second try
        (``sent_first``: the client has the first tokens) the prefill only has to hold the
        prompt's KV: its own tokens are not used, and no stop may end it there.

        ``local``: no prefill; the decode prefills the prompt itself and its stream begins with
        the first token (serve/router/prefill_path.py)."""
        pre: dict[str, Any] | None = None
        prefill_url = ""
        firsts: list[int] = []
        finished: Any = None
        held = False
        live: list[tuple[int, int]] = [(0, -1)]  # the one choice; its first token comes later
        running = {0}
        first: int | None = None
        if not local:
            prefill_body: dict[str, Any] = {
                "request_id": rid, "prompt_ids": req.prompt_ids, "max_tokens": req.max_tokens,
                "sampling": req.sampling, "stop_token_ids": req.stop_token_ids,
                "ignore_eos": req.ignore_eos}
            if req.n > 1:
                prefill_body["n"] = req.n
            if req.logprobs is not None:
                prefill_body["logprobs"] = req.logprobs
            if req.prompt_logprobs is not None:
                prefill_body["prompt_logprobs"] = req.prompt_logprobs
            if sent_first is not None:  # its tokens and log-probabilities are not used
                prefill_body.update(stop_token_ids=[], ignore_eos=True)
                prefill_body.pop("logprobs", None)
                prefill_body.pop("prompt_logprobs", None)
            try:
                prefill_url, pre = await self.run_prefill(rid, prefill_body, trip, skip, wait)
                trip.stamps[timing.R_PREFILL_GOT] = time.monotonic()
                trip.prefill_timing = pre.get("timing")
                trip.cached_tokens = _cached_tokens(pre)
                if sent_first is None:  # counted once, however many prefills it took
                    self._count_path(trip, REMOTE)
            except asyncio.CancelledError:
                # The client left while the prefill ran: it may hold blocks for this id by now.
                if trip.prefill is not None:
                    self.release_soon(trip.prefill, rid)
                raise
            chosen = _first_tokens(pre, req.n)
            if chosen is None:
                self.release_soon(prefill_url, rid, pre.get("kv_transfer_params"))
                raise ApiError(502, f"prefill {prefill_url}: answer without a first_token"
                               + ("" if req.n == 1 else f" and {req.n} first_tokens"))
            firsts = chosen if sent_first is None else sent_first
            if sent_first is None:
                try:
                    _take_logprobs(req, pre, prefill_url, trip)
                except ApiError:
                    self.release_soon(prefill_url, rid, pre.get("kv_transfer_params"))
                    raise
            # Pre-v2 prefills send no finish_reason and hold the blocks until released or read.
            finished = pre.get("finish_reason") if sent_first is None else None
            held = pre.get("finish_reason") is None
            # The choices the decode runs: those their first token did not end (a stop id, or on
            # the prefill a grammar it completed).
            ended = pre.get("first_finish_reasons") if req.n > 1 else None
            if isinstance(ended, list) and len(ended) == req.n:
                trip.finishes.update({j: "stop" for j, f in enumerate(ended) if f == "stop"})
            live = [(j, t) for j, t in enumerate(firsts)
                    if t not in req.local_stop_ids and j not in trip.finishes]
            running = {j for j, _ in live}
            first = live[0][1] if live else firsts[0]
        resp: aiohttp.ClientResponse | None = None
        complete = False
        decoded: list[int] = []  # the first live choice's (it keys the decode's prefix)
        try:
            if local:
                pass
            elif req.max_tokens == 0:  # an echo of the prompt alone: the prefill held nothing
                trip.finish = "length"
                return
            if sent_first is None and not local:
                for j, t in enumerate(firsts):
                    yield j, [t]
                # The hand-off waits one loop turn: the other prefill answers that arrived
                # with this one reach their clients first (a burst's prefill step ends 64
                # requests at once, and opening a decode stream costs as much as a relay).
                await asyncio.sleep(0)
            if not local and (finished is not None or req.max_tokens == 1 or not live):
                trip.finish = finished
                return
            try:
                resp = await self._open_decode(rid, live, pre, req, trip)
            except ApiError as exc:
                if exc.status == 502 and exc.type == "transfer":  # the KV could not be read
                    raise PrefillLost(prefill_url, exc) from None
                raise
            if local:
                self._count_path(trip, str(trip.path))
            # Every line that arrived is taken at once: while the router keeps up that is one
            # token, and when it falls behind the tokens go to the client in one write.
            pending = b""
            eof = False
            while not eof:
                try:
                    data = await resp.content.readany()
                except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                    raise ApiError(502, f"decode {trip.decode}: stream broke: "
                                   f"{type(exc).__name__}: {exc}") from None
                eof = not data
                lines = (pending + data).split(b"\n")
                pending = b"" if eof else lines.pop()
                batch: list[int] = []
                at = live[0][0]  # the choice ``batch`` is of
                for line in lines:
                    token = _token_line(line) if req.logprobs is None else None
                    if token is not None:
                        decoded.append(token)
                        batch.append(token)
                        continue
                    tagged = _choice_token_line(line) if req.n > 1 else None
                    if tagged is None and not line.strip():
                        continue
                    if tagged is None:
                        try:
                            msg = json.loads(line)
                        except (json.JSONDecodeError, UnicodeDecodeError):
                            msg = None
                        if not isinstance(msg, dict) or (
                                "token" in msg and not is_int(msg["token"])) or (
                                "choice" in msg and not is_int(msg["choice"])):
                            raise ApiError(502, f"decode {trip.decode}: bad stream line "
                                           f"{line[:200]!r}")
                        if "timing" in msg:
                            trip.decode_timing = msg["timing"]
                        if "token" in msg:
                            tagged = (int(msg.get("choice", at)), int(msg["token"]))
                            if req.logprobs is not None:
                                if not entry_ok(msg.get("logprob")):
                                    raise ApiError(502, f"decode {trip.decode}: token line "
                                                   "without its log-probabilities: "
                                                   f"{line[:200]!r}")
                                if tagged[0] in running:
                                    trip.logprobs[tagged[0]].append(msg["logprob"])
                    if tagged is not None:
                        choice, token = tagged
                        if choice not in running:
                            raise ApiError(502, f"decode {trip.decode}: a token of choice "
                                           f"{choice}, which it does not run")
                        if choice != at and batch:
                            yield at, batch
                            batch = []
                        at = choice
                        if choice == live[0][0]:
                            decoded.append(token)
                        batch.append(token)
                        continue
                    if batch:  # the client sees these tokens before the stream's end
                        yield at, batch
                        batch = []
                    if "error" in msg:
                        status = msg.get("status")
                        if not isinstance(status, int) or isinstance(status, bool):
                            status = 502
                        raise upstream_error("decode", str(trip.decode), status, msg)
                    complete = True
                    held = False
                    trip.finish = msg.get("finish_reason")
                    if req.n > 1:
                        trip.finishes.update(_choice_finishes(msg))
                    trip.transfer = msg.get("transfer")
                    if local:
                        trip.cached_tokens = _cached_tokens(msg)
                    # It holds the KV of all it was fed: the prompt, the first token and
                    # every token it generated but the last (its stream began with the first
                    # token when it prefilled the prompt itself).
                    self.decode.served(str(trip.decode), [
                        *req.prompt_ids, *([] if first is None else [first]), *decoded[:-1]])
                    return
                if batch:
                    yield at, batch
            raise ApiError(502, f"decode {trip.decode}: stream ended without its final line")
        finally:
            if resp is not None:
                self.decode.finished(str(trip.decode))
                if complete:
                    resp.release()
                else:
                    resp.close()
            if held and pre is not None:
                self.release_soon(prefill_url, rid, pre.get("kv_transfer_params"))

    async def generate(self, rid: str, req: GenRequest, trip: Trip,
                       emit: Emit | None, outs: list[Output] | None = None) -> list[Output]:
        """Run one request; `emit(choice, steps)` sees each step `(token_ids, text,
        finish_reason)` of a choice, those of its tokens that arrived together in one call (and
        may read `outs`, each choice's answer so far, for what a step carries beside its text:
        tool-call deltas). Returns each choice's output, by index."""
        outs = outs or [Output(req, self.model) for _ in range(req.n)]
        upstream = self.tokens(rid, req, trip)
        start = time.monotonic()
        first_at: float | None = None
        count = 0
        try:
            done = False
            async for choice, batch in upstream:
                out = outs[choice]
                steps: list[Step] = []
                before = count
                cut = False  # this side ended the choice with this batch
                for token in batch:
                    if out.finish is not None:
                        done = True  # the instance goes on past this side's stop (pre-v2 do)
                        break
                    count += 1
                    steps.append(([token], out.add(token), out.finish))
                    if out.stopped_by_string:
                        done = cut = True
                        break
                # Another choice still running keeps the stream open (n > 1); the decode
                # stops generating the one this side ended.
                done = done and all(o.finish is not None for o in outs)
                if cut and not done and trip.decode:
                    self.soon(self.end_choice(str(trip.decode), rid, choice))
                # Stamped as they are handed over: the event that ends a stream carries the
                # timing, its own tokens' stamps included.
                now = time.monotonic()
                if before == 0 and count:
                    first_at = now
                    self.metrics.ttft_seconds.observe(first_at - start, trip.exemplar())
                    trip.stamps[timing.R_FIRST_TOKEN] = first_at
                if before < 2 <= count:
                    trip.stamps[timing.R_SECOND_TOKEN] = now
                if emit is not None and steps:
                    await emit(choice, steps)
                if done:
                    break
            else:
                for j, out in enumerate(outs):
                    if out.finish is None:
                        text = out.end(trip.finishes.get(j, trip.finish))
                        if emit is not None:
                            await emit(j, [([], text, out.finish)])
        finally:
            await upstream.aclose()
            longest = max(len(o.token_ids) for o in outs)  # a choice's, for the per-token time
            if first_at is not None and longest > 1:
                self.metrics.tpot_seconds.observe((time.monotonic() - first_at) / (longest - 1))
        return outs
