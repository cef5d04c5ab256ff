"""Prefill instance API: run prompts in batches, hold their blocks for a decode, hand back where
they are.

`POST /v1/prefill {"request_id", "prompt_ids", "max_tokens", "sampling", "stop_token_ids",
"ignore_eos", "logprobs", "prompt_logprobs", "n"}` answers the first token (chosen by the
request's sampling), `finish_reason` (set when that token, of every choice, already ends the
completion, and then nothing is held; `max_tokens` 0 runs the prompt alone), `cached_tokens`
(prompt tokens whose KV the prefix cache already had), with `logprobs: k` the first token's
log-probability entry (`[logprob, rank, [[id, logprob] x k]]`, serve/instance/common.py), with
`prompt_logprobs: k` one for each prompt token from the second on (such a prompt bypasses the
prefix cache: its every position runs), with `n` > 1 (at most 16) `first_tokens`, one per
choice from the same logits, each drawn with its choice's seed (engine/sampling.py
`choice_seed`; the first is `first_token`; `logprobs` then has an entry per choice, in order;
the prompt's are computed once), and `first_finish_reasons`
("stop" for a choice its first token ended: a stop id, or its grammar complete; else null), and
the `kv_transfer_params` a decode instance needs to READ the KV. Held blocks stay until every
prefill rank has its notifications or the lease runs out. The parameters are a grant signed
with the deployment's key. `POST /v1/release {"kv_transfer_params"}` frees a request the router
gave up on without waiting for the lease; `POST /v1/claim {"kv_transfer_params", "hold_s"}` is a
decode rank pinning the blocks right before its READ (410 once they were released or reused).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.engine.sampling import MAX_CHOICES
from pdd_sidecar.engine.scheduler import (
    CACHED_TOKENS,
    CHOICES,
    FIRST_FINISHES,
    FIRST_TOKENS,
    LOGPROBS,
    PROMPT_LOGPROBS,
    Sequence,
)
from pdd_sidecar.engine.speculative.mtp_served import DRAFT_STATE
from pdd_sidecar.engine.worker import RequestError
from pdd_sidecar.kv.handoff import TransferParams
from pdd_sidecar.serve.instance import spans
from pdd_sidecar.serve.instance.common import (
    GRANT_ERRORS,
    STATE,
    InstanceState,
    RequestRecord,
    bad,
    error_response,
    finished,
    grant_refusal,
    int_field,
    logprob_json,
    logprobs_field,
    read_json,
    request_id,
    sequence_error,
    sequence_options,
    token_ids,
)

MAX_HOLD_S = 600.0


async def run_prefill(request: web.Request, state: InstanceState,
                      body: dict[str, Any]) -> tuple[Sequence, TransferParams | None]:
    """The finished prefill of a request body, and what a decode reads when it holds KV
    (RequestError on refusal)."""
    received = time.monotonic()
    state.require_serving("prefill")
    rid = request_id(body, lambda: uuid.uuid4().hex)
    prompt = token_ids(state, body.get("prompt_ids"), "prompt_ids")
    # 0: the prompt alone (its log-probabilities); nothing is held for a decode
    max_tokens = int_field(body, "max_tokens", None, 0)
    total = len(prompt) + (max_tokens or 1)
    if total > state.max_model_len:
        raise bad(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens "
                  f"({max_tokens or 1}) = {total} exceeds the maximum model length "
                  f"{state.max_model_len}")
    n = int_field(body, "n", 1, 1)
    assert n is not None
    if n > MAX_CHOICES:
        raise bad(f"n: at most {MAX_CHOICES} choices per request, got {n}")
    seq = Sequence(rid, prompt, 1 << 30 if max_tokens is None else max_tokens, len(prompt),
                   prompt_logprobs=logprobs_field(body, "prompt_logprobs"),
                   **sequence_options(state, body))
    seq.extra[timing.RECEIVED] = received
    if n > 1:
        seq.extra[CHOICES] = n
    await finished(request, state, seq)
    err = sequence_error(seq)
    if err:
        raise err
    held = seq.finish_reason is None
    return seq, _held_params(state, seq, len(prompt)) if held else None


def _held_params(state: InstanceState, seq: Sequence, num_tokens: int) -> TransferParams:
    """Where a decode reads the blocks ``seq`` holds on this instance."""
    s = state.settings
    return TransferParams(
        request_id=seq.id,
        instance_id=state.worker.instance_id,
        host=s.pod_ip,
        side_channel_port=s.side_channel_port,
        tp=s.tp,
        dcp=s.dcp,
        block_size=s.block_size,
        block_ids=tuple(seq.blocks),
        num_tokens=num_tokens,
        plan_digest=state.worker.compat.plan_digest,
        epoch=seq.extra["epoch"],
        expires_at=seq.extra["expires_at"],
        # An instance spanning pods says where each rank is read from (signed with the rest).
        rank_endpoints=tuple(state.worker.endpoints) if s.spans_pods else None,
        lease_seconds=s.lease_seconds,
        # the decode's first MTP draft's input, when this prefill runs the module
        draft_state=seq.extra.get(DRAFT_STATE),
    )


async def prefill(request: web.Request) -> web.Response:
    state = request.app[STATE]
    rec = RequestRecord(state.metrics, "prefill")
    seq: Sequence | None = None
    try:
        seq, held = await run_prefill(request, state, await read_json(request))
        rec.ok()
        answer = {
            "request_id": seq.id,
            "first_token": seq.output[0],
            "finish_reason": seq.finish_reason,
            "cached_tokens": int(seq.extra.get(CACHED_TOKENS, 0)),
            "kv_transfer_params": held.to_grant(state.worker.key) if held else None,
            "timing": timing.prefill_timing(seq.extra),
        }
        if seq.logprobs is not None:
            answer["logprobs"] = logprob_json(seq.extra.get(LOGPROBS, []))
        if seq.prompt_logprobs is not None:
            answer["prompt_logprobs"] = logprob_json(seq.extra.get(PROMPT_LOGPROBS, []))
        if FIRST_TOKENS in seq.extra:
            answer["first_tokens"] = seq.extra[FIRST_TOKENS]
            answer["first_finish_reasons"] = seq.extra[FIRST_FINISHES]
        return web.json_response(answer)
    except Exception as exc:
        return rec.failed(exc)
    finally:
        if tracing.enabled():
            spans.prefill(tracing.extract(request.headers), seq, rec.start, rec.status,
                          rec.error)
        rec.close()


def _own_grant(state: InstanceState, body: dict[str, Any]) -> TransferParams:
    """A grant this instance signed; anything else is refused (403)."""
    try:
        grant = TransferParams.from_own_grant(body.get("kv_transfer_params"), state.worker.key)
    except GRANT_ERRORS as exc:
        raise grant_refusal(exc) from None
    if grant.instance_id != state.worker.instance_id:
        raise RequestError(f"kv_transfer_params: granted by instance {grant.instance_id}, "
                           f"not this one ({state.worker.instance_id})", 403, "forbidden")
    return grant


async def release(request: web.Request) -> web.Response:
    """Takes the grant itself: only who was handed the blocks can give them back early."""
    state = request.app[STATE]
    try:
        body = await read_json(request)
        grant = _own_grant(state, body)
        released = await state.call_release(grant.request_id)
    except Exception as exc:
        return error_response(exc)
    state.metrics.requests.labels(role="prefill", endpoint="release", outcome="ok").inc()
    return web.json_response({"released": bool(released)})


async def claim(request: web.Request) -> web.Response:
    """A decode rank is about to READ: pin the blocks, or 410 when their epoch is gone."""
    state = request.app[STATE]
    try:
        body = await read_json(request)
        grant = _own_grant(state, body)
        hold_s = body.get("hold_s")
        if isinstance(hold_s, bool) or not isinstance(hold_s, int | float) or not (
                0 < hold_s <= MAX_HOLD_S):
            raise bad(f"hold_s: must be a number in (0, {MAX_HOLD_S:.0f}], got {hold_s!r}")
        refused = state.driver.claim(grant.request_id, grant.epoch, float(hold_s))
        if refused:  # its kind says why (lease_expired | grant_refused): the decode counts it
            raise RequestError(refused, 410, refused.cause)
    except Exception as exc:
        return error_response(exc)
    return web.json_response({"claimed": True})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/release", release)
    app.router.add_post("/v1/claim", claim)
