"""A stand-in OTLP/HTTP receiver for benchmarks: answers every export at once and counts the spans,
so a traced stack pays its real cost (spans built, batched, serialised and sent over HTTP)
without a trace backend on the machine."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class TraceSink:
    """``url`` is the base an OTLP/HTTP exporter takes (OTEL_EXPORTER_OTLP_ENDPOINT)."""

    def __init__(self) -> None:
        sink = self
        self.spans = 0
        self.exports = 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                n = sum(len(ss.spans) for rs in ExportTraceServiceRequest.FromString(body)
                        .resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += n
                    sink.exports += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
