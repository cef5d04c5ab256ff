"""An instance's spans of one request, made once it is answered from the stamps the instance
took anyway (engine/timing.py), under the context the router sent (W3C ``traceparent``).

Prefill: ``pdd.prefill`` (the request in this instance), with ``pdd.prefill.queue`` (received
until its first chunk's step) and ``pdd.prefill.compute`` (that step until its first token was
chosen). Decode: ``pdd.decode``, with ``pdd.decode.queue`` (received until its blocks were
allocated and the pull handed to the ranks), ``pdd.kv_handoff`` (the KV pull: bytes, path,
claim and READ time of the rank the sequence waited for, its failure cause) and
``pdd.decode.first_token`` (the step that chose its first token). Attributes follow the
OpenTelemetry GenAI conventions where they name the quantity (``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``gen_ai.response.finish_reasons``); the rest are ``pdd.*``.
Nothing is built when tracing is off or the request is not sampled.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Sequence
from pdd_sidecar.serve.instance.common import choice_members

# How the hand-off's path is named in a trace: NIXL moves KV over UCX (its one backend here,
# spec.kvTransfer.backend), a peer on this host's GPUs by a device copy over CUDA IPC.
PATHS = {"nixl": "ucx", "cuda_ipc": "cuda_ipc"}


def _error(seq: Sequence | None, status: int | None) -> str | None:
    if seq is not None and seq.error:
        return str(seq.error.get("error") or seq.error)
    return None if status is None or status < 400 else f"HTTP {status}"


def _server_span(name: str, parent: Context, start: float,
                 attrs: dict[str, Any]) -> tuple[Span, Context] | None:
    """The request's span in this instance and the context its children take; None (the span
    ended) when it is not recorded, so no child is built."""
    span = tracing.start_span(name, parent, SpanKind.SERVER, start, attrs)
    if not span.is_recording():
        span.end()
        return None
    return span, tracing.with_span(span)


def prefill(parent: Context, seq: Sequence | None, start: float, status: int,
            error: str | None = None) -> None:
    """The prefill's spans of one request (``seq`` None: refused before it was made)."""
    end = time.monotonic()
    attrs: dict[str, Any] = {"http.response.status_code": status,
                             "gen_ai.operation.name": "text_completion"}
    extra: Mapping[str, Any] = {}
    if seq is not None:
        extra = seq.extra
        cached = int(extra.get(CACHED_TOKENS, 0))
        attrs.update({
            "pdd.request_id": seq.id,
            "gen_ai.usage.input_tokens": len(seq.prompt),
            "pdd.prefill.cached_tokens": cached,
            "pdd.prefill.computed_tokens": len(seq.prompt) - cached,
            "pdd.prefill.chunks": int(extra.get(timing.CHUNKS, 0)),
            "pdd.kv.held_blocks": len(seq.blocks) if seq.finish_reason is None else 0,
        })
        if seq.finish_reason is not None:
            attrs["gen_ai.response.finish_reasons"] = [seq.finish_reason]
    err = error or _error(seq, status)
    opened = _server_span("pdd.prefill", parent, start, attrs)
    if opened is None:
        return
    span, ctx = opened
    for name, a, b in (("pdd.prefill.queue", timing.RECEIVED, timing.STEP_START),
                       ("pdd.prefill.compute", timing.STEP_START, timing.STEP_END)):
        if a in extra and b in extra:
            tracing.record_span(name, ctx, extra[a], extra[b])
    tracing.end_span(span, end, err)


def decode(parent: Context, seq: Sequence | None, start: float, status: int,
           attempt: str | None = None, error: str | None = None) -> None:
    """The decode's spans of one request, ended as its stream ends."""
    end = time.monotonic()
    attrs: dict[str, Any] = {"http.response.status_code": status}
    extra: Mapping[str, Any] = {}
    members: list[Sequence] = []
    if seq is not None:
        extra = seq.extra
        members = choice_members(seq)
        attrs.update({
            "pdd.request_id": seq.id,
            "gen_ai.usage.output_tokens": sum(len(m.output) for m in members),
            "pdd.decode.cached_tokens": int(extra.get(CACHED_TOKENS, 0)),
            "gen_ai.response.finish_reasons": [m.finish_reason or "" for m in members],
        })
        if timing.STEP_END in extra:
            attrs["pdd.decode.first_token_ms"] = round(
                (extra[timing.STEP_END] - extra.get(timing.RECEIVED, start)) * 1e3, 3)
        if timing.SPEC_DRAFT_TOKENS in extra:  # speculative decoding drafted for it
            attrs["pdd.speculative.draft_tokens"] = extra[timing.SPEC_DRAFT_TOKENS]
            attrs["pdd.speculative.accepted_tokens"] = extra.get(timing.SPEC_ACCEPTED_TOKENS, 0)
    err = error or _error(seq, status)
    opened = _server_span("pdd.decode", parent, start, attrs)
    if opened is None:
        return
    span, ctx = opened
    received, admitted = extra.get(timing.RECEIVED), extra.get(timing.ADMITTED)
    if received is not None and admitted is not None:
        tracing.record_span("pdd.decode.queue", ctx, received, admitted)
    if admitted is not None:
        _handoff(ctx, seq, admitted, attempt)
    if timing.STEP_START in extra and timing.STEP_END in extra:
        tracing.record_span("pdd.decode.first_token", ctx, extra[timing.STEP_START],
                            extra[timing.STEP_END])
    tracing.end_span(span, end, err)


def _handoff(ctx: Context, seq: Sequence | None, admitted: float, attempt: str | None) -> None:
    """The KV pull, from the pull handed to the ranks until the slowest rank's claim and READ
    were done (or the first step, where none is timed)."""
    assert seq is not None
    extra = seq.extra
    ranks = {r: t for r, t in (extra.get("transfer") or {}).items() if t}
    slowest = timing.slowest_pull(ranks)
    done = admitted + sum(slowest) if slowest else extra.get(timing.STEP_START, admitted)
    errors = extra.get("pull_errors") or {}
    first_error = errors[min(errors)] if errors else None
    attrs: dict[str, Any] = {
        "pdd.kv.bytes": sum(int(t.get("bytes", 0)) for t in ranks.values()),
        "pdd.kv.descriptors": sum(int(t.get("descriptors", 0)) for t in ranks.values()),
        "pdd.kv.path": ",".join(sorted({PATHS.get(str(t.get("path")), str(t.get("path")))
                                        for t in ranks.values()})) or None,
        "pdd.kv.ranks": len(ranks),
        "pdd.kv.claim_ms": round(slowest[0] * 1e3, 3) if slowest else None,
        "pdd.kv.read_ms": round(slowest[1] * 1e3, 3) if slowest else None,
        "pdd.kv.retries": max(0, int(attempt) - 1) if attempt and attempt.isdigit() else 0,
        "pdd.kv.failure_cause": first_error.get("cause") if first_error else None,
    }
    tracing.record_span("pdd.kv_handoff", ctx, admitted, done, attrs,
                        error=str(first_error.get("error")) if first_error else None)
