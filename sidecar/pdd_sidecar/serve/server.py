"""`python -m pdd_sidecar serve`: start an instance's ranks and serve its HTTP API on rank 0.

Common endpoints live here (/healthz, /readyz, /metrics, /v1/info, /v1/stats); the role's own
endpoints come from prefill_server or decode_server.
"""

from __future__ import annotations

import asyncio
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

from pdd_sidecar.engine.driver import InstanceDriver
from pdd_sidecar.engine.worker import RankWorker
from pdd_sidecar.env import ConfigError, InstanceSettings
from pdd_sidecar.kv.grants import GrantError, load_key
from pdd_sidecar.kv.side_channel import handshake
from pdd_sidecar.metrics import CONTENT_TYPE_LATEST, InstanceMetrics
from pdd_sidecar.model.config import ConfigError as ModelConfigError
from pdd_sidecar.model.config import load_config
from pdd_sidecar.routing_file import load_routing_file
from pdd_sidecar.serve import decode_api, prefill_api, vllm_api
from pdd_sidecar.serve.common import STATE, InstanceState

log = logging.getLogger(__name__)

async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.driver.fatal:
        return web.json_response({"status": "broken", "error": state.driver.fatal}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = {"ready": state.ready, "peers": state.peer_status,
            "plan_digest": state.worker.compat.plan_digest}
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
    free = driver.cache.num_free
    sched = driver.scheduler
    return web.json_response({
        "ranks": [{"rank": r, "free_blocks": free, "held_requests": len(leases)}
                  for r in range(state.settings.tp)],
        "num_blocks": state.settings.num_blocks,
        "running": len(sched.running) + len(sched.pulling),
        "waiting": len(sched.waiting),
        "leases": {"held": len(leases), "expired_total": leases.expired_total,
                   "released_total": leases.released_total},
    })


async def _check_own_ranks(state: InstanceState) -> None:
    """Ready needs every rank's side channel to answer a handshake with our own record."""
    s = state.settings
    host = "127.0.0.1" if s.bind_host in ("0.0.0.0", "::", "") else s.bind_host
    loop = asyncio.get_running_loop()
    while True:
        try:
            await state.call({"op": "stats"})
            for r in range(s.tp):
                await loop.run_in_executor(
                    None, handshake, host, s.side_channel_port + r,
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
    app = web.Application(client_max_size=16 * 1024 * 1024)
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
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _setup_logging(settings, rank)
    try:
        worker = RankWorker(rank, settings, RoutingPlan.from_json(plan_text), plan_text,
                            instance_id)
        worker.follow()
    except BaseException:
        time.sleep(0.2)  # rank 0 gone closes our sockets a moment before we are reparented
        if os.getppid() != parent:  # rank 0 is gone; its collectives broke, nothing to report
            os._exit(1)
        log.critical("rank %d failed: %s", rank, traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _watch_children(children: list[Any]) -> None:
    while True:
        for p in children:
            if not p.is_alive():
                log.critical("rank process %s exited (%s); the instance cannot go on",
                             p.name, p.exitcode)
                for q in children:
                    if q.is_alive():
                        q.kill()
                os._exit(1)
        time.sleep(0.5)


def serve(env: Mapping[str, str] | None = None) -> int:
    """Run one instance until killed; exit 2 on a configuration the instance must refuse."""
    try:
        settings = InstanceSettings.from_env(env)
        plan, plan_text = load_routing_file(
            settings.routing_file, settings.role, settings.tp, settings.dcp, settings.block_size
        )
        load_key(settings.grant_key_file)
        load_config(settings.model_source)  # an unsupported checkpoint is refused by name
    except (ConfigError, GrantError, ModelConfigError) as exc:
        print(f"pdd-sidecar: refusing to start: {exc}", file=sys.stderr, flush=True)
        return 2
    _setup_logging(settings, 0)
    # The driver thread runs the steps; HTTP threads must hand it the GIL back quickly.
    sys.setswitchinterval(0.0005)
    instance_id = uuid.uuid4().hex[:12]
    children = []
    if settings.tp > 1:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        for rank in range(1, settings.tp):
            p = ctx.Process(target=_child, args=(rank, settings, plan_text, instance_id),
                            name=f"rank{rank}", daemon=True)
            p.start()
            children.append(p)
        threading.Thread(target=_watch_children, args=(children,), daemon=True).start()
    try:
        worker = RankWorker(0, settings, plan, plan_text, instance_id)
    except Exception:
        log.critical("rank 0 failed to start: %s", traceback.format_exc())
        for p in children:
            p.kill()
        return 1
    metrics_ = InstanceMetrics(settings.role)
    driver = InstanceDriver(worker, metrics_)
    driver.start()
    state = InstanceState(worker, driver, metrics_)
    log.info("%s instance %s: tp=%d dcp=%d, HTTP on %s:%d, side channels %d..%d",
             settings.role, instance_id, settings.tp, settings.dcp, settings.bind_host,
             settings.http_port, settings.side_channel_port,
             settings.side_channel_port + settings.tp - 1)
    web.run_app(build_app(state), host=settings.bind_host, port=settings.http_port,
                print=None, handle_signals=False, access_log=None)
    return 0
