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
Nothing is built when tracing is off or the request is not sampled. The spans go out as one
``tracing.SpanPlan`` a request: with OTLP the exporting child makes and sends them, so the
instance pays for a plan, not for the SDK's spans.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Sequence
from pdd_sidecar.serve.instance.common import choice_members
from pdd_sidecar.tracing import SpanPlan

# How the hand-off's path is named in a trace: NIXL moves KV over UCX (its one backend here,
# spec.kvTransfer.backend), a peer on this host's GPUs by a device copy over CUDA IPC.
PATHS = {"nixl": "ucx", "cuda_ipc": "cuda_ipc"}


def _error(seq: Sequence | None, status: int | None) -> str | None:
    if seq is not None and seq.error:
        return str(seq.error.get("error") or seq.error)
    return None if status is None or status < 400 else f"HTTP {status}"


def prefill(parent: Context, seq: Sequence | None, start: float, status: int,
            error: str | None = None) -> None:
    """The prefill's spans of one request (``seq`` None: refused before it was made)."""
    end = time.monotonic()
    if not tracing.sampled(parent, "pdd.prefill", SpanKind.SERVER):
        return
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
    children = tuple(SpanPlan(name, extra[a], extra[b])
                     for name, a, b in (("pdd.prefill.queue", timing.RECEIVED, timing.STEP_START),
                                        ("pdd.prefill.compute", timing.STEP_START,
                                         timing.STEP_END))
                     if a in extra and b in extra)
    tracing.emit(SpanPlan("pdd.prefill", start, end, attrs, SpanKind.SERVER,
                          error or _error(seq, status), children), parent)


def decode(parent: Context, seq: Sequence | None, start: float, status: int,
           attempt: str | None = None, error: str | None = None) -> None:
    """The decode's spans of one request, ended as its stream ends."""
    end = time.monotonic()
    if not tracing.sampled(parent, "pdd.decode", SpanKind.SERVER):
        return
    attrs: dict[str, Any] = {"http.response.status_code": status}
    extra: Mapping[str, Any] = {}
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
    children: list[SpanPlan] = []
    received, admitted = extra.get(timing.RECEIVED), extra.get(timing.ADMITTED)
    if received is not None and admitted is not None:
        children.append(SpanPlan("pdd.decode.queue", received, admitted))
    if admitted is not None:
        children.append(_handoff(seq, admitted, attempt))
    if timing.STEP_START in extra and timing.STEP_END in extra:
        children.append(SpanPlan("pdd.decode.first_token", extra[timing.STEP_START],
                                 extra[timing.STEP_END]))
    tracing.emit(SpanPlan("pdd.decode", start, end, attrs, SpanKind.SERVER,
                          error or _error(seq, status), tuple(children)), parent)


def _handoff(seq: Sequence | None, admitted: float, attempt: str | None) -> SpanPlan:
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
    return SpanPlan("pdd.kv_handoff", admitted, done, attrs,
                    error=str(first_error.get("error")) if first_error else None)
