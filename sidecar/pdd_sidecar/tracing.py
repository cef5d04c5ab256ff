"""OpenTelemetry traces of one request across the router, the prefill, the hand-off and the decode.

Off by default, and then nothing is exported and no SDK is loaded: the OpenTelemetry API's own
no-op tracer answers, which still carries a client's W3C ``traceparent`` through (its trace id
appears in the logs and is passed on to the next hop), at the cost of a context lookup per span.

On when the standard environment names an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; a PDDeployment's ``spec.tracing`` sets them) or
``OTEL_TRACES_EXPORTER`` asks for ``otlp`` or ``console``; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turns it off whatever else is set. The exporter speaks OTLP over
gRPC or HTTP/protobuf as ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``
say (default ``http/protobuf``, the specification's). Everything else is the SDK's own reading
of the standard variables: the sampler (``OTEL_TRACES_SAMPLER``, ``_ARG``; the operator renders
``parentbased_traceidratio``), the resource (``OTEL_SERVICE_NAME``, default ``pdd-<role>``;
``OTEL_RESOURCE_ATTRIBUTES``), the batch processor (``OTEL_BSP_*``), headers, timeouts and
certificates of the exporter (``OTEL_EXPORTER_OTLP_*``).

Spans are mostly made after the fact from the monotonic stamps the processes already take
(engine/timing.py), with explicit start and end times: nothing is added to the engine's path.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from pdd_sidecar.tracing_plan import TRACER_NAME as TRACER_NAME
from pdd_sidecar.tracing_plan import SpanPlan as SpanPlan
from pdd_sidecar.tracing_plan import clean as clean
from pdd_sidecar.tracing_plan import epoch_ns as epoch_ns
from pdd_sidecar.tracing_plan import make_spans

log = logging.getLogger(__name__)

# The standard variables read here (the SDK reads the others itself).
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_TRACES_SAMPLER = "OTEL_TRACES_SAMPLER"
OTEL_TRACES_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"

PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "http/protobuf"
EXPORTERS = ("otlp", "console", "none")
SAMPLER = "parentbased_traceidratio"  # what the operator renders: the client's choice wins
TRACEPARENT = "traceparent"
# Sent by the router with each decode request: which hand-off of the request this is (1 the
# first; more after a decode refused it or its prefill was lost), for the hand-off's span.
HANDOFF_ATTEMPT_HEADER = "x-pdd-handoff-attempt"



class TracingConfigError(ValueError):
    """A tracing variable holds a value this process cannot serve; names the variable."""


@dataclass(frozen=True)
class TraceSettings:
    """What this process exports: ``exporter`` None is off."""

    exporter: str | None  # otlp | console | None
    protocol: str
    endpoint: str | None  # as given; None: the exporter's default for the protocol
    service_name: str


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        quoted = [repr(a) for a in allowed]
        choices = ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
        raise TracingConfigError(f"{name}: must be one of {choices}, got {value!r}")
    return value


def settings_from_env(role: str, env: Mapping[str, str] | None = None) -> TraceSettings:
    """The tracing settings the standard environment asks of a process of ``role``; raises
    TracingConfigError naming the variable and the value it cannot serve."""
    env = os.environ if env is None else env
    service = env.get(OTEL_SERVICE_NAME, "").strip() or f"pdd-{role}"
    protocol = _one_of(
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL if env.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
        else OTEL_EXPORTER_OTLP_PROTOCOL,
        (env.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or env.get(OTEL_EXPORTER_OTLP_PROTOCOL)
         or DEFAULT_PROTOCOL).strip(), PROTOCOLS)
    endpoint = (env.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
                or env.get(OTEL_EXPORTER_OTLP_ENDPOINT) or "").strip() or None
    raw = env.get(OTEL_TRACES_EXPORTER, "").strip().lower()
    # A list is allowed by the specification; one exporter is what a process here runs.
    exporter = _one_of(OTEL_TRACES_EXPORTER, raw, EXPORTERS) if raw else None
    if env.get(OTEL_SDK_DISABLED, "").strip().lower() == "true" or exporter == "none":
        return TraceSettings(None, protocol, endpoint, service)
    if exporter is None:
        exporter = "otlp" if endpoint is not None else None
    return TraceSettings(exporter, protocol, endpoint, service)


_lock = threading.Lock()
_provider: Any = None  # the SDK's TracerProvider once set up in this process
_plan_sink: Any = None  # the exporting child's submit_plan, where spans are made there


def _exporter(s: TraceSettings, role: str) -> Any:
    """Console spans are printed here; OTLP ones are encoded and sent by a child process
    (tracing_export.py), off this process's GIL."""
    if s.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from pdd_sidecar.tracing_export import ChildProcessExporter

    return ChildProcessExporter(s.protocol, role, s.service_name)


def setup(role: str, env: Mapping[str, str] | None = None) -> TraceSettings:
    """Install this process's tracer provider as the settings say (once per process; a second
    call returns the settings and changes nothing). Off: nothing is imported or installed."""
    global _provider, _plan_sink
    settings = settings_from_env(role, env)
    if settings.exporter is None:
        return settings
    with _lock:
        if _provider is not None:
            return settings
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME over these;
        # the sampler comes from OTEL_TRACES_SAMPLER(_ARG), parent-based always-on by default.
        provider = TracerProvider(resource=Resource.create(
            {SERVICE_NAME: settings.service_name, "pdd.role": role}))
        exporter = _exporter(settings, role)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _provider = provider
        _plan_sink = getattr(exporter, "submit_plan", None)
    log.info("tracing: %s spans as %s to %s over %s", settings.exporter, settings.service_name,
             settings.endpoint or "the exporter's default endpoint", settings.protocol)
    return settings


def enabled() -> bool:
    """Whether this process exports spans (cheap: callers skip building attributes when not)."""
    return _provider is not None


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush what is queued and stop exporting (a process leaving on SIGTERM calls it)."""
    global _provider, _plan_sink
    with _lock:
        provider, _provider = _provider, None
        _plan_sink = None
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))
        provider.shutdown()


_tracer: tuple[object, Tracer] | None = None


def tracer() -> Tracer:
    """This process's tracer, made once per tracer provider: the SDK builds a new one on every
    ``get_tracer`` (a third of a span's cost, 116 us for a decode's four spans on a 2-core
    machine)."""
    global _tracer
    provider = trace.get_tracer_provider()
    if _tracer is None or _tracer[0] is not provider:
        _tracer = (provider, provider.get_tracer(TRACER_NAME))
    return _tracer[1]


# --- W3C trace context across the hops


def extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The context a request's headers carry (``traceparent``, ``tracestate``, ``baggage`` as
    OTEL_PROPAGATORS says; W3C by default); an empty context when they carry none or garbage."""
    return propagate.extract(headers)


def inject(headers: MutableMapping[str, str],
           ctx: otel_context.Context | None = None) -> MutableMapping[str, str]:
    """Add the trace context of ``ctx`` (default: the current one) to outgoing headers."""
    propagate.inject(headers, context=ctx)
    return headers


def with_span(span: Span, ctx: otel_context.Context | None = None) -> otel_context.Context:
    """A context whose current span is ``span`` (to parent children on it, or inject it)."""
    return trace.set_span_in_context(span, ctx)


def trace_id(span: Span | None = None) -> str | None:
    """The 32-hex trace id of ``span`` (default: the current span), None when there is none."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None


def context_trace_id(ctx: otel_context.Context) -> str | None:
    """The trace id a context (as ``extract`` returns it) carries."""
    return trace_id(trace.get_current_span(ctx))


def sampled_trace_id(ctx: otel_context.Context) -> str | None:
    """The trace id of a context's span when that span is sampled (exported), else None."""
    sc = trace.get_current_span(ctx).get_span_context()
    return trace.format_trace_id(sc.trace_id) if sc.is_valid and sc.trace_flags.sampled \
        else None


# --- spans


def start_span(name: str, parent: otel_context.Context | None = None,
               kind: SpanKind = SpanKind.INTERNAL, start_s: float | None = None,
               attributes: Mapping[str, Any] | None = None) -> Span:
    """A span started at monotonic ``start_s`` (now when None), child of ``parent``'s span."""
    return tracer().start_span(
        name, context=parent, kind=kind,
        start_time=None if start_s is None else epoch_ns(start_s),
        attributes=clean(attributes) if attributes else None)


def end_span(span: Span, end_s: float | None = None, error: str | None = None,
             attributes: Mapping[str, Any] | None = None) -> None:
    """Set the outcome and end ``span`` at monotonic ``end_s`` (now when None)."""
    if span.is_recording():
        if attributes:
            span.set_attributes(clean(attributes))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end_s is None else epoch_ns(end_s))


def sampled(parent: otel_context.Context | None, name: str,
            kind: SpanKind = SpanKind.INTERNAL) -> bool:
    """Whether a span ``name`` under ``parent`` would be recorded: tracing on here and the
    sampler keeps it (decided here as the exporting child decides it: the same sampler on the
    same parent and trace id; without a parent a new trace is the child's to decide). Callers
    ask before building a plan's attributes."""
    provider = _provider
    if provider is None:
        return False
    sc = trace.get_current_span(parent).get_span_context()
    return not sc.is_valid or provider.sampler.should_sample(
        parent, sc.trace_id, name, kind).decision.is_sampled()


_drop_listeners: list[weakref.WeakMethod[Callable[[], Any]]] = []


def on_dropped(listener: Callable[[], Any]) -> None:
    """``listener()`` (a bound method: held weakly) is called for each span plan the exporting
    child could not take: the metrics count them (``pdd_trace_plans_dropped``)."""
    _drop_listeners.append(weakref.WeakMethod(listener))  # type: ignore[arg-type]


def emit(plan: SpanPlan, parent: otel_context.Context | None) -> None:
    """The plan's spans under ``parent``: handed to the exporting child, which makes and sends
    them off this process's GIL, else made here. Nothing when ``sampled`` says no."""
    sink = _plan_sink
    if not sampled(parent, plan.name, plan.kind):
        return
    if sink is None:
        make_spans(plan, parent, tracer())
        return
    sc = trace.get_current_span(parent).get_span_context()
    if sink(inject({}, parent) if sc.is_valid else {}, plan) is False:
        for ref in list(_drop_listeners):
            listener = ref()
            if listener is None:
                _drop_listeners.remove(ref)
            else:
                listener()
