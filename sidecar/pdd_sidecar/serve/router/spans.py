"""The router's spans of one request, beside the routing they describe.

``<gen_ai.operation.name> <model>`` (the OpenTelemetry GenAI conventions' name: ``chat`` or
``text_completion``) is the request in the router, a child of the client's ``traceparent`` when it
sent one; its children ``pdd.route.prefill`` and ``pdd.route.decode`` are each routing decision
and why: the policy, the replica chosen among how many ready ones, the prompt tokens the chosen
replica most likely caches (the policy's prefix index) against the best any candidate had, its
load (busy requests, free KV share, score) and the reason (``prefix_match``, ``least_loaded``,
``overloaded_prefix_owner``, ``rendezvous``, ``round_robin``). The instances' spans hang under the
request's span through the ``traceparent`` the router sends them (serve/instance/spans.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.serve import access_log
from pdd_sidecar.serve.openai.openai_request import GenRequest
from pdd_sidecar.serve.router.replica_pool import Pool
from pdd_sidecar.serve.router.routing_policy import CacheAware, ReplicaLoad, rendezvous


class Trip(Protocol):
    """What the request span reads of upstreams.Trip (where one prompt went)."""

    prefill: str | None
    decode: str | None
    stamps: dict[str, float]
    prefill_timing: Any
    decode_timing: Any
    cached_tokens: int
    handoffs: int
    output_tokens: int
    path: str | None

OPERATIONS = {"completion": "text_completion", "chat": "chat"}  # gen_ai.operation.name


class RequestSpan:
    """The request's span in the router and the context its calls carry."""

    def __init__(self, span: Span, operation: str) -> None:
        self.span = span
        self.context = tracing.with_span(span)
        self.operation = operation

    @classmethod
    def start(cls, request: web.Request, kind: str, model: str,
              start: float) -> RequestSpan | None:
        """None (nothing made, nothing sent on) when tracing is off here and the client sent
        no traceparent; else the span, a child of the client's context, its trace id noted
        for the access log."""
        if not tracing.enabled() and tracing.TRACEPARENT not in request.headers:
            return None
        op = OPERATIONS.get(kind, kind)
        span = tracing.start_span(f"{op} {model}", tracing.extract(request.headers),
                                  SpanKind.SERVER, start, {
                                      "gen_ai.operation.name": op,
                                      "gen_ai.request.model": model,
                                      "http.request.method": request.method,
                                      "url.path": request.path})
        tid = tracing.trace_id(span)
        if tid is not None:
            request[access_log.TRACE_ID] = tid
        return cls(span, op)

    def requested(self, rid: str, reqs: Sequence[GenRequest]) -> None:
        if not self.span.is_recording():
            return
        req = reqs[0]
        sampling = req.sampling or {}
        self.span.set_attributes(tracing.clean({
            "gen_ai.response.id": rid,
            "gen_ai.request.max_tokens": req.max_tokens,
            "gen_ai.request.temperature": sampling.get("temperature"),
            "gen_ai.request.top_p": sampling.get("top_p"),
            "gen_ai.request.top_k": sampling.get("top_k"),
            "gen_ai.request.seed": sampling.get("seed"),
            "gen_ai.request.choice.count": req.n if req.n != 1 else None,
            "gen_ai.usage.input_tokens": sum(len(r.prompt_ids) for r in reqs),
            "pdd.prompts": len(reqs) if len(reqs) > 1 else None,
        }))

    def end(self, status: int, error: str | None, trips: Sequence[Trip]) -> None:
        attrs: dict[str, Any] = {"http.response.status_code": status}
        if self.span.is_recording() and trips:
            trip = trips[0]
            t = timing.request_timing(trip.stamps, trip.prefill_timing, trip.decode_timing)
            attrs.update({
                "gen_ai.usage.output_tokens": sum(tr.output_tokens for tr in trips),
                "pdd.prefill": trip.prefill, "pdd.decode": trip.decode,
                # remote_prefill, local_prefill or fallback (prefill_path.py)
                "pdd.request_path": trip.path,
                "pdd.prefill.cached_tokens": sum(tr.cached_tokens for tr in trips),
                "pdd.handoff.attempts": sum(tr.handoffs for tr in trips),
                "pdd.ttft_ms": t.get("ttft"), "pdd.second_token_ms": t.get("second_token"),
            })
        tracing.end_span(self.span, error=error, attributes=attrs)


def decision(pool: Pool, url: str, candidates: Sequence[str],
             prompt_ids: Sequence[int] | None) -> dict[str, Any]:
    """Why ``url`` was picked among ``candidates``: read from the pool before the request is
    recorded there (recording it makes every prefix a hit)."""
    policy = pool.policy
    load = pool.load.get(url, ReplicaLoad())
    attrs: dict[str, Any] = {
        "pdd.route.role": pool.role, "pdd.route.policy": policy.name,
        "pdd.route.replica": url, "pdd.route.candidates": len(candidates),
        "pdd.route.load.busy": load.busy, "pdd.route.load.free_fraction":
        round(load.free_fraction, 4), "pdd.route.load.score": round(load.score, 4),
        "pdd.route.cache_hit_tokens": 0,
    }
    if pool.plans.get(url):
        attrs["pdd.route.plan"] = pool.plans[url]
    if not isinstance(policy, CacheAware):
        attrs["pdd.route.reason"] = ("least_loaded" if policy.name == "least-loaded"
                                     else "round_robin")
        return attrs
    keys = policy.index.keys(prompt_ids) if prompt_ids else []
    matched = {u: policy.index.match(u, keys) for u in candidates} if keys else {}
    block = policy.index.block_size
    hit, best = matched.get(url, 0), max(matched.values(), default=0)
    attrs["pdd.route.cache_hit_tokens"] = hit * block
    attrs["pdd.route.best_cache_hit_tokens"] = best * block
    if hit and hit == best:
        reason = "prefix_match"
    elif best:
        reason = "overloaded_prefix_owner"  # the replica holding more was too busy
    elif policy.shared and keys and url == max(candidates, key=lambda u: rendezvous(u, keys[0])):
        reason = "rendezvous"
    else:
        reason = "least_loaded"
    attrs["pdd.route.reason"] = reason
    return attrs


def record_decision(parent: Context | None, pool: Pool, url: str, candidates: Sequence[str],
                    prompt_ids: Sequence[int] | None, started: float) -> None:
    """The ``pdd.route.<role>`` span of one pick, as a plan the exporting child makes (nothing
    is read when it would not be recorded)."""
    name = f"pdd.route.{pool.role}"
    if parent is None or not tracing.sampled(parent, name):
        return
    tracing.emit(tracing.SpanPlan(name, started, time.monotonic(),
                                  decision(pool, url, candidates, prompt_ids)), parent)
