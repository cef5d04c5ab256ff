"""Prefill instance API: run prompts in batches, hold their blocks for a decode, hand back where
they are.

`POST /v1/prefill {"request_id", "prompt_ids", "max_tokens", "sampling", "stop_token_ids",
"ignore_eos"}` answers the first token (chosen by the request's sampling), `finish_reason` (set
when that token already ends the completion, and then nothing is held), and the
`kv_transfer_params` a decode instance needs to READ the KV. Held blocks stay until every prefill
rank has its notifications or the lease runs out. `POST /v1/release {"request_id"}` frees a
request the router gave up on without waiting for the lease.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from pdd_sidecar.engine.scheduler import Sequence
from pdd_sidecar.serve.common import (
    STATE,
    bad,
    error_response,
    finished,
    int_field,
    read_json,
    request_id,
    sequence_error,
    sequence_options,
    token_ids,
)


async def prefill(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m = state.metrics
    start = time.monotonic()
    outcome = "error"
    try:
        state.require_serving("prefill")
        body = await read_json(request)
        rid = request_id(body, lambda: uuid.uuid4().hex)
        prompt = token_ids(state, body.get("prompt_ids"), "prompt_ids")
        max_tokens = int_field(body, "max_tokens", None, 1)
        total = len(prompt) + (max_tokens or 1)
        if total > state.max_model_len:
            raise bad(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens "
                      f"({max_tokens or 1}) = {total} exceeds the maximum model length "
                      f"{state.max_model_len}")
        seq = Sequence(rid, prompt, max_tokens or 1 << 30, len(prompt),
                       **sequence_options(state, body))
        await finished(request, state, seq)
        err = sequence_error(seq)
        if err:
            raise err
        s = state.settings
        held = seq.finish_reason is None
        outcome = "ok"
        return web.json_response({
            "request_id": rid,
            "first_token": seq.output[0],
            "finish_reason": seq.finish_reason,
            "kv_transfer_params": {
                "host": s.pod_ip,
                "side_channel_port": s.side_channel_port,
                "instance_id": state.worker.instance_id,
                "tp": s.tp,
                "dcp": s.dcp,
                "block_size": s.block_size,
                "block_ids": seq.blocks,
                "num_tokens": len(prompt),
                "plan_digest": state.worker.compat.plan_digest,
                "lease_seconds": s.lease_seconds,
            } if held else None,
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
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise bad("request_id: must be a non-empty string")
        released = await state.call_release(rid)
    except Exception as exc:
        return error_response(exc)
    state.metrics.requests.labels(role="prefill", endpoint="release", outcome="ok").inc()
    return web.json_response({"released": bool(released)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/release", release)
