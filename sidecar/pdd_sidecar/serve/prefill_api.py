"""Prefill instance API: run the prompt, hold its blocks for the decode, hand back where they are.

`POST /v1/prefill {"request_id", "prompt_ids"}` answers the first (greedy) token and the
`kv_transfer_params` a decode instance needs to READ the KV; the blocks stay held until every
prefill rank has its notifications or the lease runs out. `POST /v1/release {"request_id"}`
frees a request the router gave up on without waiting for the lease.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from pdd_sidecar.engine.instance import RequestError
from pdd_sidecar.serve.server import STATE, error_response, first_error, read_json


async def prefill(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m = state.metrics
    start = time.monotonic()
    outcome = "error"
    try:
        if not state.ready:
            raise RequestError(f"not ready: {state.not_ready_reason}", 503, "not_ready")
        body = await read_json(request)
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        prompt = body.get("prompt_ids")
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(t, int) and t >= 0 for t in prompt)):
            raise RequestError("prompt_ids must be a non-empty list of token ids", 400)
        results = await state.call({"op": "prefill", "id": rid, "tokens": prompt})
        err = first_error(results)
        if err:
            raise err
        s = state.settings
        head = results[0]
        m.tokens.labels(kind="prompt").inc(len(prompt))
        outcome = "ok"
        return web.json_response({
            "request_id": rid,
            "first_token": head["first_token"],
            "kv_transfer_params": {
                "host": s.pod_ip,
                "side_channel_port": s.side_channel_port,
                "instance_id": state.worker.instance_id,
                "tp": s.tp,
                "dcp": s.dcp,
                "block_size": s.block_size,
                "block_ids": head["block_ids"],
                "num_tokens": len(prompt),
                "plan_digest": state.worker.compat.plan_digest,
                "lease_seconds": s.lease_seconds,
            },
        })
    except Exception as exc:
        return error_response(exc)
    finally:
        m.requests.labels(role="prefill", endpoint="prefill", outcome=outcome).inc()
        m.request_seconds.labels(role="prefill", endpoint="prefill").observe(
            time.monotonic() - start)


async def release(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await read_json(request)
        released = await state.call({"op": "release", "id": str(body.get("request_id", ""))})
    except Exception as exc:
        return error_response(exc)
    state.metrics.requests.labels(role="prefill", endpoint="release", outcome="ok").inc()
    return web.json_response({"released": bool(released)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/release", release)
