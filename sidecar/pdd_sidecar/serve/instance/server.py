"""`python -m pdd_sidecar serve`: start an instance's ranks and serve its HTTP API on rank 0.

Common endpoints live here (/healthz, /readyz, /metrics, /v1/info, /v1/stats); the role's own
endpoints come from prefill_server or decode_server.

An instance may span the pods of a LeaderWorkerSet group (LWS_GROUP_SIZE > 1): pod k runs ranks
k*g .. k*g+g-1. The leader (pod 0) is rank 0 and serves the API; a worker pod runs its ranks as
children and serves only probes, and exits non-zero as soon as one of its ranks is gone (a rank
whose leader or peer went away exits too, its collectives broken), so the group's restart policy
recreates the whole group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pdd_sidecar import tracing
from pdd_sidecar.engine.driver import InstanceDriver
from pdd_sidecar.engine.speculative.config import SpeculativeConfig
from pdd_sidecar.engine.worker import RankWorker
from pdd_sidecar.env import PDD_SPECULATIVE_METHOD, ConfigError, InstanceSettings
from pdd_sidecar.kv.grants import GrantError, load_key
from pdd_sidecar.kv.pool_sizing import SizingError
from pdd_sidecar.kv.side_channel import handshake
from pdd_sidecar.metrics import CONTENT_TYPE_LATEST, InstanceMetrics
from pdd_sidecar.model.config import ConfigError as ModelConfigError
from pdd_sidecar.model.config import load_config
from pdd_sidecar.routing_file import load_routing_file
from pdd_sidecar.serve import access_log
from pdd_sidecar.serve.discovery import INSTANCE_KEEPALIVE_S
from pdd_sidecar.serve.event_loop import loop_kind, new_event_loop, uvloop_installed
from pdd_sidecar.serve.instance import decode_api, prefill_api, vllm_api
from pdd_sidecar.serve.instance.common import STATE, InstanceState

log = logging.getLogger(__name__)

async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.driver.fatal:
        return web.json_response({"status": "broken", "error": state.driver.fatal}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    sched = state.driver.scheduler
    body = {"ready": state.ready, "peers": state.peer_status,
            "plan_digest": state.worker.compat.plan_digest,
            # What one sequence can hold at most (every block of every DCP rank but those the
            # driver keeps), so a router refuses a request no instance could ever hold before
            # any prefill runs it, and reports the max_model_len really served.
            "kv_capacity_tokens": state.worker.pool.sequence_tokens,
            # What the router weighs replicas by (serve/router/routing_policy.py); cheap to read.
            "load": {"running": len(sched.running) + len(sched.pulling),
                     "waiting": len(sched.waiting), "free_blocks": sched.allocator.num_free,
                     "num_blocks": sched.allocator.num_blocks}}
    if state.settings.role == "decode":
        # It prefills a prompt itself when asked (decode_api.py, local_prefill): a router sends
        # such requests only to a decode that says so (an older one would refuse them).
        body["local_prefill"] = True
        # What its prefix cache reuses at a time, so the router's estimate of what it caches
        # counts whole units only (engine/driver.py: block size x DCP).
        body["cache_unit_tokens"] = state.settings.block_size * state.settings.dcp
    if not state.ready:
        body["reason"] = state.not_ready_reason
        return web.json_response(body, status=503)
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.expose(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def info(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].info())


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    driver = state.driver
    leases = driver.leases
    free = driver.allocator.num_free
    sched = driver.scheduler
    return web.json_response({
        "ranks": [{"rank": r, "free_blocks": free, "held_requests": len(leases)}
                  for r in range(state.settings.tp)],
        "num_blocks": state.worker.pool.blocks,
        # kept by the driver for itself, never free (engine/graphed_hits.py's scratch)
        "reserved_blocks": sched.reserved_blocks,
        "running": len(sched.running) + len(sched.pulling),
        "waiting": len(sched.waiting),
        "leases": {"held": len(leases), "expired_total": leases.expired_total,
                   "released_total": leases.released_total},
    })


async def _check_own_ranks(state: InstanceState) -> None:
    """Ready needs every rank's side channel, on every pod, to answer a handshake with our own
    record."""
    s = state.settings
    local_host = "127.0.0.1" if s.bind_host in ("0.0.0.0", "::", "") else s.bind_host
    loop = asyncio.get_running_loop()
    while True:
        try:
            await state.call({"op": "stats"})
            for r, (host, port) in enumerate(state.worker.endpoints):
                await loop.run_in_executor(
                    None, handshake, local_host if r in s.local_ranks else host, port,
                    state.worker.compat, f"{s.role} {s.replica} rank 0", s.handshake_timeout_s,
                    state.worker.key,
                )
            state.ranks_ready = True
            if state.peers_ready:
                state.not_ready_reason = ""
            return
        except Exception as exc:
            state.not_ready_reason = f"own side channels not answering: {exc}"
            await asyncio.sleep(0.5)


def build_app(state: InstanceState) -> web.Application:
    @web.middleware
    async def count_in_flight(request: web.Request, handler: Any) -> web.StreamResponse:
        """A draining instance exits only once no request is being answered (common.py)."""
        if request.method != "POST":
            return await handler(request)  # type: ignore[no-any-return]
        state.in_flight += 1
        try:
            return await handler(request)  # type: ignore[no-any-return]
        finally:
            state.in_flight -= 1

    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[
        access_log.middleware(access_log.enabled()), count_in_flight])
    app[STATE] = state
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/health", readyz)  # vLLM's name, for proxies written to its flow
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/info", info)
    app.router.add_get("/v1/stats", stats)
    (prefill_api if state.settings.role == "prefill" else decode_api).add_routes(app)
    vllm_api.add_routes(app)

    async def background(app: web.Application) -> Any:
        def on_term() -> None:
            if not state.draining:
                threading.Thread(target=state.drain_and_exit, args=(state.settings.drain_s,),
                                 daemon=True).start()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
        tasks = [asyncio.create_task(_check_own_ranks(state))]
        if state.settings.role == "decode":
            tasks.append(asyncio.create_task(
                decode_api.watch_prefill_peers(state, app[decode_api.PEERS])))
        yield
        for t in tasks:
            t.cancel()

    app.cleanup_ctx.append(background)
    return app


# ---------------------------------------------------------------- processes


def _setup_logging(settings: InstanceSettings, rank: int) -> None:
    level = os.environ.get("PDD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {settings.role}-{settings.replica} r{rank} %(levelname)s "
        f"%(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("nixl").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.5)


def _child(rank: int, settings: InstanceSettings, plan_text: str, instance_id: str) -> None:
    from pdd_api.plan import RoutingPlan

    parent = os.getppid()
    # A SIGTERM to the whole process group (some runtimes and init shims send one) must not
    # stop a rank while rank 0 drains the requests that need it: ranks end with rank 0.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _setup_logging(settings, rank)
    try:
        worker = RankWorker(rank, settings, RoutingPlan.from_json(plan_text), plan_text,
                            instance_id)
        worker.follow()
    except SizingError as exc:
        log.critical("rank %d refusing to start: %s", rank, exc)
        os._exit(1)
    except BaseException:
        time.sleep(0.2)  # rank 0 gone closes our sockets a moment before we are reparented
        if os.getppid() != parent:  # rank 0 is gone; its collectives broke, nothing to report
            os._exit(1)
        log.critical("rank %d failed: %s", rank, traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _watch_children(children: list[Any], interval_s: float = 0.5) -> None:
    while True:
        for p in children:
            if not p.is_alive():
                log.critical("rank process %s exited (%s); the instance cannot go on",
                             p.name, p.exitcode)
                for q in children:
                    if q.is_alive():
                        q.kill()
                os._exit(1)
        time.sleep(interval_s)


def _start_ranks(settings: InstanceSettings, ranks: range, plan_text: str,
                 instance_id: str) -> list[Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    children = []
    for rank in ranks:
        p = ctx.Process(target=_child, args=(rank, settings, plan_text, instance_id),
                        name=f"rank{rank}", daemon=True)
        p.start()
        children.append(p)
    return children


def _serve_worker_pod(settings: InstanceSettings, plan_text: str) -> int:
    """A worker pod of a group: its ranks follow rank 0 on the leader; HTTP answers probes only.

    SIGTERM does not stop the ranks at once: the leader drains its requests first, and those
    need every rank; the ranks end when the leader goes, or after the drain bound."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    s = settings
    children = _start_ranks(s, s.local_ranks, plan_text, "worker")
    threading.Thread(target=_watch_children, args=(children, 0.2), daemon=True).start()

    class Probe(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:
            body: dict[str, Any]
            if self.path not in ("/healthz", "/readyz", "/health"):
                code, body = 404, {"error": "not found"}
            else:
                gone = [p.name for p in children if not p.is_alive()]
                code = 503 if gone else 200
                body = {"status": "broken" if gone else "ok", "pod": s.worker_index,
                        "ranks": list(s.local_ranks), "gone": gone}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer((s.bind_host, s.http_port), Probe)
    httpd.daemon_threads = True

    def on_term(signum: int, frame: Any) -> None:
        def stop() -> None:
            deadline = time.monotonic() + s.drain_s + 5
            while time.monotonic() < deadline and any(p.is_alive() for p in children):
                time.sleep(0.2)
            for p in children:
                if p.is_alive():
                    p.kill()
            os._exit(0)

        threading.Thread(target=stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    log.info("%s instance worker pod %d of %d: ranks %d..%d, probes on %s:%d",
             s.role, s.worker_index, s.group_size, s.local_ranks.start, s.local_ranks.stop - 1,
             s.bind_host, s.http_port)
    httpd.serve_forever()
    return 0


def speculative_config(settings: InstanceSettings) -> SpeculativeConfig | None:
    """The decode's drafting (engine/speculative/) as its settings ask (None on a prefill);
    ConfigError naming the variable for a method this sidecar cannot run."""
    s = settings.speculative
    if s is None:
        return None
    if s.method == "mtp":  # the module is loaded by every rank (engine/worker.py)
        cfg = load_config(settings.model_source)
        if cfg.num_nextn_predict_layers < 1:
            raise ConfigError(f"{PDD_SPECULATIVE_METHOD}: 'mtp' needs a checkpoint with an MTP "
                              f"module, and model {settings.model_source!r} has none "
                              f"(num_nextn_predict_layers 0); use 'ngram'")
        if settings.role != "decode":
            return None  # a prefill fills the module's latents and the draft state only
    more: dict[str, int | float] = {}
    if s.max_batch is not None:
        more["max_batch"] = s.max_batch
    if s.min_acceptance is not None:
        more["min_acceptance"] = s.min_acceptance
    try:
        return SpeculativeConfig.from_settings(s.method, s.tokens, ngram_max=s.ngram_max,
                                               ngram_min=s.ngram_min, **more)
    except ValueError as exc:
        raise ConfigError(f"{PDD_SPECULATIVE_METHOD}: this sidecar cannot draft so ({exc})"
                          ) from None


def serve(env: Mapping[str, str] | None = None) -> int:
    """Run one instance until killed; exit 2 on a configuration the instance must refuse."""
    try:
        settings = InstanceSettings.from_env(env)
        plan, plan_text = load_routing_file(
            settings.routing_file, settings.role, settings.tp, settings.dcp, settings.block_size
        )
        load_key(settings.grant_key_file)
        load_config(settings.model_source)  # an unsupported checkpoint is refused by name
        speculative = speculative_config(settings)
        loop = loop_kind(settings.event_loop, uvloop_installed())
        tracing.settings_from_env(settings.role, env)  # OTEL_* it cannot serve: refused
    except (ConfigError, GrantError, ModelConfigError, tracing.TracingConfigError) as exc:
        print(f"pdd-sidecar: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    # The driver and pull threads give the GIL up in every torch call; the HTTP threads must
    # hand it back quickly (the ranks forked below inherit this).
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    if not settings.is_leader:
        _setup_logging(settings, settings.local_ranks.start)
        return _serve_worker_pod(settings, plan_text)
    _setup_logging(settings, 0)
    tracing.setup(settings.role, env)  # the HTTP process makes the spans (instance/spans.py)
    instance_id = uuid.uuid4().hex[:12]
    children = []
    if settings.ranks_per_pod > 1:
        children = _start_ranks(settings, settings.local_ranks[1:], plan_text, instance_id)
        threading.Thread(target=_watch_children, args=(children,), daemon=True).start()
    try:
        worker = RankWorker(0, settings, plan, plan_text, instance_id)
    except SizingError as exc:  # the memory settings do not fit this GPU: a setting to change
        for p in children:
            p.kill()
        log.critical("refusing to start: %s", exc)
        print(f"pdd-sidecar: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        log.critical("rank 0 failed to start: %s", traceback.format_exc())
        for p in children:
            p.kill()
        return 1
    metrics_ = InstanceMetrics(settings.role)
    metrics_.gc_pauses.install()
    driver = InstanceDriver(worker, metrics_, speculative=speculative)
    driver.start()
    state = InstanceState(worker, driver, metrics_)
    log.info("%s instance %s: tp=%d dcp=%d over %d pod(s), HTTP on %s:%d, side channels %s",
             settings.role, instance_id, settings.tp, settings.dcp, settings.group_size,
             settings.bind_host, settings.http_port,
             ", ".join(f"{h}:{p}" for h, p in worker.endpoints))
    web.run_app(build_app(state), host=settings.bind_host, port=settings.http_port,
                print=None, handle_signals=False, access_log=None,
                keepalive_timeout=INSTANCE_KEEPALIVE_S,
                loop=new_event_loop(loop, f"{settings.role} instance"))
    return 0
