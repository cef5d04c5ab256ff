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


PLANS = f"""
from opentelemetry.trace import SpanKind
from pdd_sidecar import tracing as T
assert T.setup("decode").exporter == "otlp"
plan = T.SpanPlan("pdd.decode", 10.0, 12.5, {{"gen_ai.usage.output_tokens": 9, "skip": None}},
                  SpanKind.SERVER, "boom", (T.SpanPlan("pdd.decode.queue", 10.0, 10.25),
                                            T.SpanPlan("pdd.kv_handoff", 10.25, 10.5,
                                                       {{"pdd.kv.bytes": 4096}})))
T.emit(plan, T.extract({{"traceparent": "{CLIENT_PARENT}"}}))
unsampled = "00-{"1" * 32}-{"2" * 16}-00"
T.emit(T.SpanPlan("pdd.dropped", 1.0, 2.0), T.extract({{"traceparent": unsampled}}))
T.shutdown()
"""


def test_plans_are_made_into_spans_by_the_child(otlp_env: HTTPServer) -> None:
    """An instance's spans go over as a plan: the child makes them under the client's
    context with the plan's times, attributes and outcome; a plan under an unsampled parent is
    dropped before it is sent."""
    import subprocess
    import sys

    env = {**os.environ, "OTEL_SERVICE_NAME": "pdd-plans",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    subprocess.run([sys.executable, "-c", PLANS], env=env, check=True, timeout=60)
    spans, services = {}, set()
    for _, body in _Receiver.bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes
                         if a.key == "service.name"}
            for ss in rs.scope_spans:
                spans.update({sp.name: sp for sp in ss.spans})
    assert set(spans) == {"pdd.decode", "pdd.decode.queue", "pdd.kv_handoff"}
    assert services == {"pdd-plans"}
    top, queue, kv = spans["pdd.decode"], spans["pdd.decode.queue"], spans["pdd.kv_handoff"]
    assert top.trace_id.hex() == CLIENT_PARENT.split("-")[1]
    assert top.parent_span_id.hex() == CLIENT_PARENT.split("-")[2]
    assert queue.parent_span_id == kv.parent_span_id == top.span_id
    assert top.end_time_unix_nano - top.start_time_unix_nano == 2_500_000_000
    assert kv.start_time_unix_nano - top.start_time_unix_nano == 250_000_000
    assert top.status.code == 2 and top.status.message == "boom"
    assert top.kind == 2  # SERVER
    assert {a.key: a.value.int_value for a in top.attributes} == {
        "gen_ai.usage.output_tokens": 9}
    assert {a.key: a.value.int_value for a in kv.attributes} == {"pdd.kv.bytes": 4096}


def test_a_plan_under_an_unsampled_parent_is_not_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler decides in the serving process, on the parent and its trace id as the child
    would: 99 of 100 plans at a ratio of 1 % cost it no pickling and no pipe."""
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    sent: list[tuple[dict[str, str], T.SpanPlan]] = []
    monkeypatch.setattr(T, "_provider", TracerProvider(sampler=ParentBasedTraceIdRatio(0.0)))
    monkeypatch.setattr(T, "_plan_sink", lambda carrier, plan: sent.append((carrier, plan)))
    plan = T.SpanPlan("pdd.decode", 1.0, 2.0)
    T.emit(plan, T.extract({"traceparent": f"00-{'1' * 32}-{'2' * 16}-00"}))
    assert sent == []
    T.emit(plan, T.extract({"traceparent": CLIENT_PARENT}))
    assert sent == [({"traceparent": CLIENT_PARENT}, plan)]
    T.emit(plan, T.extract({}))  # no parent: a new trace, the child's sampler decides
    assert sent[-1] == ({}, plan)


def test_a_plan_the_child_cannot_take_is_counted_on_metrics(otlp_env: HTTPServer,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """Past MAX_QUEUED_PLANS waiting, submit_plan drops the plan and says so; emit passes
    that on to every metrics object's counter (an instance's and a router's)."""
    import gc

    from pdd_sidecar import tracing_export
    from pdd_sidecar.metrics import InstanceMetrics, RouterMetrics

    exporter = ChildProcessExporter("http/protobuf")
    try:
        plan = T.SpanPlan("pdd.decode", 1.0, 2.0)
        assert exporter.submit_plan({}, plan) is True
        monkeypatch.setattr(tracing_export, "MAX_QUEUED_PLANS", 0)
        assert exporter.submit_plan({}, plan) is False and exporter.dropped_plans == 1
        inst, router = InstanceMetrics("decode"), RouterMetrics()
        monkeypatch.setattr(T, "_plan_sink", exporter.submit_plan)
        monkeypatch.setattr(T, "sampled", lambda *a, **k: True)
        T.emit(plan, None)
        T.emit(plan, None)
        assert inst.registry.get_sample_value("pdd_trace_plans_dropped_total") == 2
        assert router.registry.get_sample_value("pdd_router_trace_plans_dropped_total") == 2
        monkeypatch.setattr(tracing_export, "MAX_QUEUED_PLANS", 8192)
        T.emit(plan, None)  # taken: not counted
        assert inst.registry.get_sample_value("pdd_trace_plans_dropped_total") == 2
        del inst  # a metrics object gone stops listening (held weakly)
        gc.collect()
        monkeypatch.setattr(tracing_export, "MAX_QUEUED_PLANS", 0)
        T.emit(plan, None)
        assert router.registry.get_sample_value("pdd_router_trace_plans_dropped_total") == 3
        assert all(ref() is not None for ref in T._drop_listeners)
    finally:
        exporter.shutdown()
