"""What a traced request costs the process that serves it, in CPU time per span: making the
spans (the decode's four: ``pdd.decode`` and its children) with the SDK, then exporting them
either in the process (the SDK's OTLP/HTTP exporter: protobuf encoding and the POST, in Python)
or by handing them to the exporting child process (pdd_sidecar/tracing_export.py: a tuple, a
pickle and a pipe write); and, as an instance now does it, handing the request's spans over as
one plan (``tracing.SpanPlan``) that the child makes into spans. A local OTLP/HTTP receiver
takes the spans; every span is checked to arrive.

    python bench/span_cost.py                 # 4,000 spans per figure
    python bench/span_cost.py --spans 400     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind  # noqa: E402

BATCH = 512  # the batch span processor's default export batch
# A decode's attributes as serve/instance/spans.py sets them, under a sampled router span.
DECODE_ATTRS = {"http.response.status_code": 200, "pdd.request_id": "cmpl-0123456789abcdef",
                "gen_ai.usage.output_tokens": 128, "pdd.decode.cached_tokens": 0,
                "gen_ai.response.finish_reasons": ["length"], "pdd.decode.first_token_ms": 4.2}
HANDOFF_ATTRS = {"pdd.kv.bytes": 1 << 20, "pdd.kv.descriptors": 16, "pdd.kv.path": "cuda_ipc",
                 "pdd.kv.ranks": 1, "pdd.kv.claim_ms": 0.4, "pdd.kv.read_ms": 0.2,
                 "pdd.kv.retries": 0}
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Sink(BaseHTTPRequestHandler):
    spans = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        n = sum(len(ss.spans) for rs in ExportTraceServiceRequest.FromString(body).resource_spans
                for ss in rs.scope_spans)
        with _Sink.lock:
            _Sink.spans += n
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def decode_plan(now: float) -> Any:
    """One request's decode spans as serve/instance/spans.py plans them."""
    from pdd_sidecar.tracing import SpanPlan

    return SpanPlan("pdd.decode", now, now + 0.5, DECODE_ATTRS, SpanKind.SERVER, None,
                    (SpanPlan("pdd.decode.queue", now, now + 0.001),
                     SpanPlan("pdd.kv_handoff", now + 0.001, now + 0.002, HANDOFF_ATTRS),
                     SpanPlan("pdd.decode.first_token", now + 0.002, now + 0.006)))


def make_spans(n_requests: int, kept: InMemorySpanExporter) -> tuple[list[ReadableSpan], float]:
    """A decode's spans for ``n_requests`` requests, made by the SDK in this process (as the
    exporting child makes them, ``tracing_plan.make_spans``) under the process's provider,
    its spans kept by ``kept``; the CPU seconds that took."""
    from pdd_sidecar import tracing, tracing_plan

    kept.clear()
    parent = tracing.extract({"traceparent": PARENT})
    tracer = tracing.tracer()
    t0 = time.process_time()
    for _ in range(n_requests):
        tracing_plan.make_spans(decode_plan(time.monotonic()), parent, tracer)
    return list(kept.get_finished_spans()), time.process_time() - t0


def plans_cpu(n_requests: int, provider: TracerProvider) -> float:
    """This process's CPU seconds (threads included) to hand ``n_requests`` decode plans to
    the exporting child, the writer's pickling and writes included."""
    from pdd_sidecar import tracing
    from pdd_sidecar.tracing_export import ChildProcessExporter

    child = ChildProcessExporter("http/protobuf", "decode", "pdd-decode")
    tracing._provider, tracing._plan_sink = provider, child.submit_plan
    parent = tracing.extract({"traceparent": PARENT})
    t0 = time.process_time()
    for _ in range(n_requests):
        tracing.emit(decode_plan(time.monotonic()), parent)
    child.shutdown()  # the writer sends the last plans
    spent = time.process_time() - t0
    tracing._provider = tracing._plan_sink = None
    return spent


def export_cpu(exporter: object, spans: list[ReadableSpan]) -> float:
    """This process's CPU seconds to export ``spans`` in batches (threads included)."""
    t0 = time.process_time()
    for i in range(0, len(spans), BATCH):
        result = exporter.export(spans[i:i + BATCH])  # type: ignore[attr-defined]
        if result.name != "SUCCESS":
            raise RuntimeError(f"export failed: {result}")
    return time.process_time() - t0


def wait_for(n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _Sink.spans < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the receiver got {_Sink.spans} spans of {n}")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=4000, help="spans per figure (4 a request)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
    from opentelemetry import trace

    from pdd_sidecar.tracing_export import ChildProcessExporter, otlp_exporter

    kept = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    trace.set_tracer_provider(provider)
    make_spans(100, kept)  # imports and caches warm
    spans, make_s = make_spans(max(1, args.spans // 4), kept)
    n = len(spans)
    in_process = otlp_exporter("http/protobuf")
    export_cpu(in_process, spans[:BATCH])
    wait_for(min(n, BATCH))
    inproc_s = export_cpu(in_process, spans)
    wait_for(min(n, BATCH) + n)
    in_process.shutdown()
    child = ChildProcessExporter("http/protobuf")
    child_s = export_cpu(child, spans)
    child.shutdown()
    wait_for(min(n, BATCH) + 2 * n)
    plan_s = plans_cpu(n // 4, provider)
    wait_for(min(n, BATCH) + 3 * n)
    server.shutdown()
    per = {"make_us": make_s / n * 1e6, "export_in_process_us": inproc_s / n * 1e6,
           "hand_to_child_us": child_s / n * 1e6, "plan_to_child_us": plan_s / n * 1e6}
    baseline = per["make_us"] + per["export_in_process_us"]  # all in the serving process
    ratios = {"make_and_hand_of_baseline": (per["make_us"] + per["hand_to_child_us"]) / baseline,
              "plan_of_baseline": per["plan_to_child_us"] / baseline}
    print(f"{n} spans ({n // 4} requests of a decode's four), CPU us per span in the serving "
          f"process: make {per['make_us']:.1f}; export in the process "
          f"{per['export_in_process_us']:.1f} (make + export {baseline:.1f}, the baseline); "
          f"hand to the exporting child {per['hand_to_child_us']:.1f} (make + hand "
          f"{per['make_us'] + per['hand_to_child_us']:.1f} = "
          f"{ratios['make_and_hand_of_baseline']:.2f}x the baseline); as a plan the child "
          f"makes {per['plan_to_child_us']:.1f} ({ratios['plan_of_baseline']:.2f}x); every "
          f"span received")
    if args.json:
        args.json.write_text(json.dumps({"spans": n, **per, **ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
