"""OTLP export from a child process (pdd_sidecar/tracing_export.py): a span handed over as a
tuple encodes to the same OTLP bytes as the span itself; the child sends what it was handed
before it ends, and a process forked from the exporting one does not keep it alive."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from http.server import HTTPServer

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from pdd_sidecar import tracing as T
from pdd_sidecar.tracing_export import ChildProcessExporter, batch_payload, spans_from_payload

from .test_tracing import CLIENT_PARENT, _Receiver, receiver  # noqa: F401


def _spans(provider: TracerProvider) -> None:
    tracer = provider.get_tracer("pdd", "1.2")
    parent = T.extract({"traceparent": CLIENT_PARENT, "tracestate": "vendor=x"})
    span = tracer.start_span("pdd.decode", parent, SpanKind.SERVER, start_time=1_000,
                             attributes={"gen_ai.usage.output_tokens": 7, "pdd.kv.path": "ucx",
                                         "gen_ai.response.finish_reasons": ["length", "stop"],
                                         "pdd.kv.read_ms": 0.25, "pdd.flag": True},
                             links=[Link(span_context_of(parent), {"why": "retry"})])
    span.add_event("first_token", {"step": 3}, timestamp=1_500)
    span.set_status(Status(StatusCode.ERROR, "boom"))
    span.end(end_time=2_000)
    child = tracer.start_span("pdd.decode.queue", T.with_span(span), start_time=1_100)
    child.end(end_time=1_200)


def span_context_of(ctx: object) -> object:
    from opentelemetry import trace

    return trace.get_current_span(ctx).get_span_context()  # type: ignore[arg-type]


def test_a_span_as_a_tuple_encodes_to_the_same_otlp_bytes() -> None:
    kept = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "pdd-decode",
                                                        "pdd.role": "decode"}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    _spans(provider)
    spans = kept.get_finished_spans()
    assert len(spans) == 2
    cache: dict[object, object] = {}
    again = spans_from_payload(batch_payload(spans), cache)
    assert encode_spans(again).SerializeToString() == encode_spans(spans).SerializeToString()
    assert len(cache) == 2  # one resource and one scope for both spans


@pytest.fixture
def otlp_env(receiver: HTTPServer, monkeypatch: pytest.MonkeyPatch  # noqa: F811
             ) -> Iterator[HTTPServer]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT",
                       f"http://127.0.0.1:{receiver.server_address[1]}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    yield receiver


def _received() -> list[str]:
    names = []
    for _, body in _Receiver.bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                names += [sp.name for sp in ss.spans]
    return names


def test_the_child_sends_what_it_was_handed_and_a_forked_process_does_not_hold_it(
        otlp_env: HTTPServer) -> None:
    exporter = ChildProcessExporter("http/protobuf")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _spans(provider)
    kept = InMemorySpanExporter()
    other = TracerProvider()
    other.add_span_processor(SimpleSpanProcessor(kept))
    _spans(other)
    assert exporter.export(kept.get_finished_spans() * 1000).name == "SUCCESS"  # > a pipe's 64 KiB
    pid = os.fork()  # as an instance forks its engine ranks
    if pid == 0:
        time.sleep(8)
        os._exit(0)
    try:
        t0 = time.monotonic()
        provider.shutdown()  # closes the pipe: the child sends, then ends
        took = time.monotonic() - t0
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert took < 5, took
    assert sorted(_received()) == ["pdd.decode"] * 1001 + ["pdd.decode.queue"] * 1001
    assert exporter.export([]).name == "FAILURE"  # after shutdown nothing is taken


KILLED = """
import sys, time
from pdd_sidecar.tracing_export import ChildProcessExporter
e = ChildProcessExporter("http/protobuf")
print(e._proc.pid, flush=True)
time.sleep(60)
"""


def test_the_child_ends_when_its_parent_is_killed(otlp_env: HTTPServer) -> None:
    """SIGKILL leaves no exporter behind: the pipe closes with the parent, and the child
    reads its end."""
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # running
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the exporting child outlived its killed parent")
