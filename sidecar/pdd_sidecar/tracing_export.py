"""OTLP export from a child process: the serving processes hand their finished spans over a pipe
as plain tuples, and the child rebuilds them and runs the OpenTelemetry exporter. Spans a process
only records after the fact (``tracing.SpanPlan``: an instance's spans of a request, the router's
routing decisions) go over as plans, and the child makes them too.

Why: in the serving process the SDK makes a span and the exporter encodes it to protobuf and
sends it, in Python, under the GIL that the process's engine loop and event loop also need;
with every request traced that cost a decode 9.9 % of its TPOT at 64 streams on an H100. Made
there and handed over, a span costs the process 0.7x of that; handed over as a plan, 0.13-0.16x
(``bench/span_cost.py``, a 2-core machine). The child is the process's own:
it reads the same environment (endpoint, protocol, headers, timeouts, sampler, resource), ends
when its pipe closes (its parent gone, or ``shutdown``), and exports what it was handed first.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import IO, Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
CHILD_MODULE = "pdd_sidecar.tracing_export"
PLAN_BATCH = 256  # plans a write, at the latest every PLAN_FLUSH_S
PLAN_FLUSH_S = 0.2
MAX_QUEUED_PLANS = 8192


def _context(ctx: Any) -> tuple[int, int, bool, int, list[tuple[str, str]]] | None:
    if ctx is None:
        return None
    return (ctx.trace_id, ctx.span_id, ctx.is_remote, int(ctx.trace_flags),
            list(ctx.trace_state.items()) if ctx.trace_state else [])


def batch_payload(spans: Sequence[ReadableSpan]) -> tuple[Any, ...]:
    """What an OTLP export reads of finished spans, as picklable values: the batch's distinct
    resources and scopes once, each span's fields with their indexes."""
    resources: dict[int, int] = {}
    resource_attrs: list[dict[str, Any]] = []
    scopes: dict[Any, int] = {}
    rows = []
    for s in spans:
        r = resources.get(id(s.resource))
        if r is None:
            r = resources[id(s.resource)] = len(resource_attrs)
            resource_attrs.append(dict(s.resource.attributes.items()))
        sc = s.instrumentation_scope
        skey = None if sc is None else (sc.name, sc.version)
        if skey not in scopes:
            scopes[skey] = len(scopes)
        events, links, attrs = s.events, s.links, s.attributes
        rows.append((
            s.name, _context(s.context), _context(s.parent), s.kind.value, s.start_time,
            s.end_time, dict(attrs.items()) if attrs else {}, s.status.status_code.value,
            s.status.description,
            [(e.name, e.timestamp, dict(e.attributes or {})) for e in events] if events else (),
            [(_context(li.context), dict(li.attributes or {})) for li in links] if links else (),
            scopes[skey], r))
    return resource_attrs, list(scopes), rows


def _span_context(t: tuple[int, int, bool, int, list[tuple[str, str]]] | None) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    if t is None:
        return None
    return SpanContext(t[0], t[1], t[2], TraceFlags(t[3]), TraceState(t[4]))


def spans_from_payload(payload: tuple[Any, ...], cache: dict[Any, Any]) -> list[ReadableSpan]:
    """``batch_payload``'s inverse (resources and scopes made once per distinct value)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    resource_attrs, scope_keys, rows = payload
    resources = []
    for attrs in resource_attrs:
        key = ("resource", tuple(sorted(attrs.items())))
        if key not in cache:
            cache[key] = Resource(attrs)
        resources.append(cache[key])
    scopes = []
    for sk in scope_keys:
        key = ("scope", sk)
        if key not in cache:
            cache[key] = None if sk is None else InstrumentationScope(sk[0], sk[1])
        scopes.append(cache[key])
    return [ReadableSpan(
        name=name, context=_span_context(ctx), parent=_span_context(parent),
        resource=resources[r], attributes=attrs,
        events=[Event(n, a, ts) for n, ts, a in events],
        links=[Link(_span_context(c), a) for c, a in links], kind=SpanKind(kind),
        status=Status(StatusCode(code), desc), start_time=start, end_time=end,
        instrumentation_scope=scopes[sc])
        for (name, ctx, parent, kind, start, end, attrs, code, desc, events, links, sc, r)
        in rows]


def otlp_exporter(protocol: str) -> Any:
    """The OTLP exporter of ``protocol``; it reads the endpoint (appending /v1/traces to a base
    URL over HTTP), headers, compression, timeout and certificates from the environment."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


class ChildProcessExporter(SpanExporter):
    """A SpanExporter whose ``export`` only pickles the batch onto the child's stdin; the child
    (``python -m pdd_sidecar.tracing_export PROTOCOL ROLE SERVICE``) runs the OTLP exporter
    and makes the plans ``submit_plan`` hands it."""

    def __init__(self, protocol: str, role: str = "", service: str = "") -> None:
        """Starts the child now, while the process starts (its imports take a CPU second)."""
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        self._plans: deque[tuple[dict[str, str], Any]] = deque()
        self.dropped_plans = 0
        self._wake = threading.Event()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, protocol, role, service], stdin=subprocess.PIPE,
            bufsize=0, env=dict(os.environ, PYTHONPATH=path))
        # A process forked from this one (an engine rank) must not hold the child's pipe open
        # (the child ends when the last holder closes it).
        os.register_at_fork(after_in_child=self._forget)
        self._writer = threading.Thread(target=self._write_plans, name="pdd-span-plans",
                                        daemon=True)
        self._writer.start()

    def submit_plan(self, carrier: dict[str, str], plan: Any) -> bool:
        """A span plan for the child, under the parent ``carrier`` names (W3C headers): queued
        here and written by this exporter's thread, so a full pipe never blocks the caller.
        False: dropped (``MAX_QUEUED_PLANS`` wait already; the caller counts it)."""
        if len(self._plans) >= MAX_QUEUED_PLANS:
            if not self.dropped_plans:
                log.warning("tracing: %d span plans wait for the exporting child; later ones "
                            "are dropped until it catches up (pdd_trace_plans_dropped counts "
                            "them)", MAX_QUEUED_PLANS)
            self.dropped_plans += 1
            return False
        self._plans.append((carrier, plan))
        if len(self._plans) >= PLAN_BATCH:
            self._wake.set()
        return True

    def _write_plans(self) -> None:
        while True:
            self._wake.wait(PLAN_FLUSH_S)
            self._wake.clear()
            batch: list[tuple[dict[str, str], Any]] = []
            while self._plans and len(batch) < 4 * PLAN_BATCH:
                batch.append(self._plans.popleft())
            if batch:
                self._send(("plans", batch))
            if self._closed and not self._plans:
                return

    def _forget(self) -> None:
        proc, self._proc = self._proc, None
        self._closed = True  # this process has no writer thread (threads do not fork)
        self._plans.clear()
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()  # this process's copy of the pipe; unbuffered: nothing sent
            except OSError:
                pass

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = self._send(("spans", batch_payload(spans)))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def _send(self, message: tuple[str, Any]) -> bool:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return False
            try:
                _write_all(self._proc.stdin, _LEN.pack(len(data)) + data)
            except (OSError, ValueError):
                if not self._warned:
                    self._warned = True
                    log.warning("tracing: the exporting child process is gone; spans are "
                                "dropped from now on")
                return False
        return True

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # what export() wrote is the child's to send; shutdown() waits for it

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close the pipe and wait for the child to send what it holds (killed past the
        timeout: no process is left behind)."""
        self._closed = True  # the plans' writer sends what is queued, then ends
        self._wake.set()
        if self._writer.is_alive():
            self._writer.join(timeout_s)
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _write_all(stream: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = stream.write(view)
        if not n:
            raise OSError("the exporting child's pipe took nothing")
        view = view[n:]


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def child_main(protocol: str, role: str, service: str, stream: IO[bytes]) -> int:
    """Export each message read from ``stream`` until it ends (span batches as they are, span
    plans made into spans by a provider configured as the parent's), then shut down."""
    from opentelemetry.propagate import extract
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdd_sidecar.tracing_plan import TRACER_NAME, make_spans

    # The parent's SIGTERM or a terminal's SIGINT reach its process group: this child ends
    # when its pipe closes instead, once it has sent what it was handed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s otlp-exporter %(levelname)s %(name)s: %(message)s")
    exporter = otlp_exporter(protocol)
    made = InMemorySpanExporter()  # the spans of one message's plans, exported as one batch
    # the sampler from OTEL_TRACES_SAMPLER(_ARG), the resource merged as the parent's is
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service,
                                                        "pdd.role": role}))
    provider.add_span_processor(SimpleSpanProcessor(made))
    tracer = provider.get_tracer(TRACER_NAME)
    cache: dict[Any, Any] = {}
    try:
        while (head := _read_exact(stream, _LEN.size)) is not None:
            body = _read_exact(stream, _LEN.unpack(head)[0])
            if body is None:
                break
            kind, payload = pickle.loads(body)
            if kind == "spans":
                exporter.export(spans_from_payload(payload, cache))
                continue
            for carrier, plan in payload:
                make_spans(plan, extract(carrier), tracer)
            exporter.export(made.get_finished_spans())
            made.clear()
    finally:
        exporter.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1], sys.argv[2], sys.argv[3], sys.stdin.buffer))
