"""Spans as data: a finished span and its children between monotonic stamps (``SpanPlan``), and
their making into OpenTelemetry spans, by the serving process (tracing.py) or by the exporting
child (tracing_export.py). Only the OpenTelemetry API here: no SDK is loaded by importing it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

TRACER_NAME = "pdd"

# time.monotonic() stamps (engine/timing.py) to the epoch nanoseconds spans carry; taken once,
# so the spans of one process keep the monotonic clock's order and durations exactly.
_MONO_TO_EPOCH_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` stamp as the epoch nanoseconds a span's start or end takes."""
    return _MONO_TO_EPOCH_NS + int(monotonic_s * 1e9)


def clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attribute values OpenTelemetry takes (None dropped, other objects as text)."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if isinstance(v, bool | int | float | str):
            out[k] = v
        elif isinstance(v, list | tuple) and all(isinstance(x, bool | int | float | str)
                                                  for x in v):
            out[k] = list(v)
        else:
            out[k] = str(v)
    return out


@dataclass(frozen=True)
class SpanPlan:
    """A finished span and its children as data, between monotonic stamps: what a process
    timed anyway, made into spans later (``emit``), by the exporting child where there is one."""

    name: str
    start_s: float
    end_s: float
    attributes: Mapping[str, Any] = field(default_factory=dict)
    kind: SpanKind = SpanKind.INTERNAL
    error: str | None = None
    children: tuple[SpanPlan, ...] = ()


def make_spans(plan: SpanPlan, parent: Context | None, tracer: Tracer) -> None:
    """The plan's spans, made and ended here; its children only where its span is recorded."""
    span = tracer.start_span(plan.name, context=parent, kind=plan.kind,
                        start_time=epoch_ns(plan.start_s),
                        attributes=clean(plan.attributes) if plan.attributes else None)
    if span.is_recording():
        ctx = trace.set_span_in_context(span, parent)
        for child in plan.children:
            make_spans(child, ctx, tracer)
        if plan.error is not None:
            span.set_status(Status(StatusCode.ERROR, plan.error))
    span.end(end_time=epoch_ns(max(plan.end_s, plan.start_s)))
