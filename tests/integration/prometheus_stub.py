"""A Prometheus HTTP API on a local port for the planner's instant queries: a subclass says
what each query is worth (``answer``), this serves it in Prometheus's JSON shape (an empty
vector for None)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class _Server(ThreadingHTTPServer):
    # The planner asks all its queries of every due PDDeployment at once: socketserver's
    # backlog of 5 dropped connections, retried past the operator's scrape timeout.
    request_queue_size = 256


class PrometheusStub:
    def __init__(self) -> None:
        self.asked: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                q = parse_qs(urlsplit(self.path).query).get("query", [""])[0]
                outer.asked.append(q)
                value = outer.answer(q)
                result = [] if value is None else [{"metric": {}, "value": [time.time(),
                                                                            str(value)]}]
                body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                                 "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, query: str) -> float | None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
