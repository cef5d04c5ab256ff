"""Tracing set-up (pdd_sidecar/tracing.py): the standard OTEL_* environment decides, off by
default; a client's traceparent is kept; spans reach an OTLP/HTTP receiver."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry import trace

from pdd_sidecar import tracing as T

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def test_off_by_default() -> None:
    s = T.settings_from_env("decode", {})
    assert s.exporter is None
    assert s.service_name == "pdd-decode"
    assert s.protocol == "http/protobuf"


def test_an_endpoint_turns_it_on() -> None:
    s = T.settings_from_env("router", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317",
                                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                                       "OTEL_SERVICE_NAME": "r1"})
    assert (s.exporter, s.protocol, s.endpoint, s.service_name) == (
        "otlp", "grpc", "http://jaeger:4317", "r1")
    traces_only = T.settings_from_env("prefill", {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    assert (traces_only.exporter, traces_only.protocol) == ("otlp", "http/protobuf")


@pytest.mark.parametrize("env", [
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_SDK_DISABLED": "true"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_TRACES_EXPORTER": "none"},
])
def test_disabled_wins(env: dict[str, str]) -> None:
    assert T.settings_from_env("decode", env).exporter is None


@pytest.mark.parametrize("env,message", [
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_PROTOCOL: must be one of 'grpc' or 'http/protobuf', got 'http/json'"),
    ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"},
     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: must be one of 'grpc' or 'http/protobuf', got 'udp'"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"},
     "OTEL_TRACES_EXPORTER: must be one of 'otlp', 'console' or 'none', got 'zipkin'"),
])
def test_bad_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(T.TracingConfigError) as err:
        T.settings_from_env("decode", env)
    assert str(err.value) == message


def test_off_keeps_the_client_trace_id() -> None:
    """With no SDK the API's no-op tracer still carries the client's context: its trace id is
    what the logs show and what the next hop is sent."""
    assert not T.enabled()
    ctx = T.extract({"traceparent": CLIENT_PARENT})
    assert T.context_trace_id(ctx) == CLIENT_TRACE
    span = T.start_span("router", ctx)
    assert not span.is_recording()
    assert T.trace_id(span) == CLIENT_TRACE
    out = T.inject({}, T.with_span(span))
    assert out["traceparent"].split("-")[1] == CLIENT_TRACE
    assert T.context_trace_id(T.extract({"traceparent": "garbage"})) is None
    assert T.context_trace_id(T.extract({})) is None


def test_epoch_ns_keeps_monotonic_order() -> None:
    assert T.epoch_ns(10.0) - T.epoch_ns(9.5) == 500_000_000
    assert abs(T.epoch_ns(__import__("time").monotonic()) - __import__("time").time_ns()) < 1e9


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers["Content-Length"])
        self.bodies.append((self.path, self.rfile.read(n)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[HTTPServer]:
    _Receiver.bodies = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


CHILD = f"""
from pdd_sidecar import tracing as T
off = T.tracer()  # made while no provider is installed
s = T.setup("router")
assert T.enabled(), s
assert T.tracer() is T.tracer() and T.tracer() is not off  # one a provider, made again
ctx = T.extract({{"traceparent": "{CLIENT_PARENT}"}})
span = T.start_span("pdd.router", ctx, attributes={{"pdd.replica": "d0", "skip": None}})
T.emit(T.SpanPlan("pdd.child", 1.0, 2.0, {{"gen_ai.usage.input_tokens": 5}}), T.with_span(span))
T.end_span(span, error="boom")
T.shutdown()
"""


def test_spans_reach_an_otlp_http_receiver(receiver: HTTPServer) -> None:
    """setup() in a fresh process (a tracer provider is installed once per process), spans
    exported over OTLP/HTTP as the environment says, parented on the client's trace."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT":
           f"http://127.0.0.1:{receiver.server_address[1]}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "pdd-test",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    spans, services = {}, set()
    for path, body in _Receiver.bodies:
        assert path == "/v1/traces"
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes
                         if a.key == "service.name"}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    spans[sp.name] = sp
    # Ratio 0, yet sampled: parent-based, and the client's traceparent says sampled.
    assert set(spans) == {"pdd.router", "pdd.child"}
    assert services == {"pdd-test"}
    router, child = spans["pdd.router"], spans["pdd.child"]
    assert router.trace_id.hex() == child.trace_id.hex() == CLIENT_TRACE
    assert router.parent_span_id.hex() == "00f067aa0ba902b7"
    assert child.parent_span_id == router.span_id
    assert child.end_time_unix_nano - child.start_time_unix_nano == 1_000_000_000
    assert router.status.code == 2 and router.status.message == "boom"
    assert {a.key for a in router.attributes} == {"pdd.replica"}


def test_setup_off_installs_nothing() -> None:
    before = trace.get_tracer_provider()
    assert T.setup("decode", {}).exporter is None
    assert trace.get_tracer_provider() is before
    assert not T.enabled()


def test_a_sampled_request_leaves_an_exemplar_on_the_router_ttft() -> None:
    """The router's TTFT carries the trace id of sampled requests, in OpenMetrics only."""
    from pdd_sidecar.metrics import RouterMetrics, wants_openmetrics

    sampled = T.extract({"traceparent": CLIENT_PARENT})
    unsampled = T.extract({"traceparent": CLIENT_PARENT[:-2] + "00"})
    assert T.sampled_trace_id(sampled) == CLIENT_TRACE
    assert T.sampled_trace_id(unsampled) is None
    m = RouterMetrics()
    m.ttft_seconds.observe(0.3, {"trace_id": CLIENT_TRACE})
    om = m.expose(openmetrics=True).decode()
    assert f'# {{trace_id="{CLIENT_TRACE}"}} 0.3' in om
    assert CLIENT_TRACE not in m.expose().decode()
    assert wants_openmetrics("application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
    assert not wants_openmetrics("text/plain")
