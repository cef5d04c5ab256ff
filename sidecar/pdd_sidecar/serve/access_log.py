"""One log line per request answered (with ``PDD_ACCESS_LOG=1``) and per error body, each naming
the request's trace id, so a slow or failed request in a log leads to its trace (docs/tracing.md).

The trace id is the one the router gave the request (its span's; the client's when it sent a
``traceparent``), which the router passes on to the prefill and the decode: one id across the
four processes' logs. An error body (status 400 and up) is logged whatever the setting, at
WARNING for a 5xx, INFO otherwise. Health, readiness and metrics requests are never logged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from pdd_sidecar import tracing

PDD_ACCESS_LOG = "PDD_ACCESS_LOG"
# The request key a handler sets when it made the request's trace (a typed key where aiohttp
# has them, 3.11 on; a plain name before).
TRACE_ID: Any = (web.RequestKey("pdd_trace_id", str) if hasattr(web, "RequestKey")
                 else "pdd_trace_id")
QUIET = frozenset({"/healthz", "/readyz", "/health", "/metrics"})
MAX_LOGGED_BODY = 4096

log = logging.getLogger("pdd.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(PDD_ACCESS_LOG, "0") not in ("", "0")


def trace_id_of(request: web.Request) -> str:
    """The request's trace id: what its handler recorded, else its traceparent's; ``-``."""
    tid = request.get(TRACE_ID)
    if tid is None and tracing.TRACEPARENT in request.headers:
        tid = tracing.context_trace_id(tracing.extract(request.headers))
    return tid or "-"


def _error_message(response: web.StreamResponse) -> str:
    body = getattr(response, "body", None)
    if not isinstance(body, bytes) or len(body) > MAX_LOGGED_BODY:
        return ""
    try:
        err = json.loads(body)["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


def middleware(access: bool) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware (outermost, to see the final status); ``access``: a line for
    every request, else for error bodies only."""

    @web.middleware
    async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in QUIET:
            return await handler(request)
        start = time.monotonic()
        status, response = 500, None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            ms = (time.monotonic() - start) * 1e3
            if status >= 400:
                message = _error_message(response) if response is not None else ""
                log.log(logging.WARNING if status >= 500 else logging.INFO,
                        "%s %s %d %.1fms trace_id=%s error: %s", request.method, request.path,
                        status, ms, trace_id_of(request), message)
            elif access:
                log.info("%s %s %d %.1fms trace_id=%s", request.method, request.path, status,
                         ms, trace_id_of(request))

    return access_log
