"""vLLM's disaggregated-serving protocol on pdd instances: `POST /v1/completions` with
`kv_transfer_params`, so a proxy written to vLLM's flow (llm-d's sidecar, vLLM's toy proxy,
AIBrix) drives pdd prefill and decode instances unchanged.

Prefill leg: the client's request with `max_tokens: 1` and `kv_transfer_params:
{"do_remote_decode": true, ...}`; the answer is a completion of one token whose
`kv_transfer_params` use vLLM's names (`do_remote_prefill`, `remote_engine_id`,
`remote_block_ids`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size`, ...) plus pdd's
own: the signed grant and the first token. Decode leg: the original request with those
parameters copied in; the answer (or SSE stream) is the whole completion, first token included.
The legs share one `X-Request-Id`. Stop strings need detokenizing and are the router's job: pdd
instances refuse them here rather than ignore them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pdd_sidecar.engine.scheduler import CACHED_TOKENS, Sequence
from pdd_sidecar.kv.handoff import TransferParams
from pdd_sidecar.serve.instance.common import (
    GRANT_ERRORS,
    STATE,
    InstanceState,
    RequestError,
    bad,
    error_response,
    finished,
    read_json,
    sequence_error,
    sequence_tokens,
)
from pdd_sidecar.serve.instance.decode_api import PEERS, decode_sequence
from pdd_sidecar.serve.instance.prefill_api import run_prefill
from pdd_sidecar.serve.openai.openai_fields import FieldError, include_usage, refusal, token_limit
from pdd_sidecar.serve.openai.structured_request import STRUCTURED, StructuredError, structured_spec
from pdd_sidecar.serve.openai.text import Codec, TextConfigError, load_model_text

GRANT = "pdd_grant"
CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
            "min_tokens")
FIRST_TOKEN = "pdd_first_token"
# What a vLLM-style proxy adds to a completions body: the hand-off, and on the prefill leg
# max_completion_tokens: 1 beside max_tokens: 1 (both are read, and must agree).
PROXY_FIELDS = frozenset({"kv_transfer_params", "max_completion_tokens"})
T = TypeVar("T")
_CODEC = web.AppKey("codec", dict[str, Any])


def vllm_params(state: InstanceState, held: TransferParams, first: int) -> dict[str, Any]:
    """The prefill's answer in vLLM's field names, with what pdd's decode needs besides."""
    s = state.settings
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": held.instance_id,
        "remote_block_ids": list(held.block_ids),
        "remote_request_id": held.request_id,
        "remote_host": held.host,
        "remote_port": held.side_channel_port,
        "tp_size": max(s.tp, s.dcp),
        "dcp_size": s.dcp,
        "pp_size": 1,
        "remote_num_tokens": held.num_tokens,
        "remote_blocks_expiry_time": held.expires_at,
        "transfer_mode": "pull",
        GRANT: held.to_grant(state.worker.key),
        FIRST_TOKEN: first,
    }


def _codec(request: web.Request) -> Codec | None:
    cache = request.app[_CODEC]
    if "codec" not in cache:
        state = request.app[STATE]
        try:
            cache["codec"] = load_model_text(state.settings.model_source).codec
        except TextConfigError:
            cache["codec"] = None
    codec: Codec | None = cache["codec"]
    return codec


def _prompt_ids(request: web.Request, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        codec = _codec(request)
        if codec is None:
            raise bad("prompt: this checkpoint has no tokenizer.json; send token ids")
        try:
            return codec.encode(prompt, True)
        except UnicodeEncodeError:
            raise bad("prompt: not valid Unicode (a lone surrogate?)") from None
    if isinstance(prompt, list):
        return prompt  # checked against the vocabulary by the prefill/decode parsers
    raise bad("prompt: must be a string or a list of token ids")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI request fields to the instance API's (whose parsers check types and ranges).
    A field that would change the answer and that pdd does not implement is refused, as the
    router refuses it (serve/openai/openai_fields.py), and so is one it does not know: only what
    vLLM's proxies add (``PROXY_FIELDS``) passes beside the table."""
    refused = refusal("completion", body, PROXY_FIELDS)
    if refused is not None:
        raise bad(refused[1])
    if body.get("stop"):
        raise bad("stop: stop strings are not supported by pdd instances in vLLM's protocol; "
                  "use stop_token_ids, or pdd's router")
    for key in ("logprobs", "top_logprobs", "echo", "prompt_logprobs"):
        value = body.get(key)
        if value is not None and value is not False and not (key == "top_logprobs"
                                                              and value == 0):
            raise bad(f"{key}: log-probabilities and echo are not served by pdd instances in "
                      "vLLM's protocol; use pdd's router")
    n = body.get("n", 1)
    if n != 1:
        raise bad(f"n: only 1 is supported, got {n!r}")
    if body.get("best_of") not in (None, 1):
        raise bad(f"best_of: only 1 is supported, got {body['best_of']!r}")
    sampling = {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "top_k": body.get("top_k", 0), "seed": body.get("seed"),
                **{k: body[k] for k in CONTROLS if body.get(k) is not None}}
    try:
        structured = structured_spec(body, compile_check=False)  # the instance compiles it
    except StructuredError as exc:
        raise bad(str(exc)) from None
    if structured is not None:
        sampling[STRUCTURED] = structured.to_json()
    return {"sampling": sampling, "stop_token_ids": body.get("stop_token_ids") or [],
            "ignore_eos": body.get("ignore_eos", False)}


def _checked(read: Callable[[Any], T], value: Any) -> T:
    """``read(value)``, its FieldError as the 400."""
    try:
        return read(value)
    except FieldError as exc:
        raise bad(str(exc)) from None


def _text(request: web.Request, ids: list[int]) -> str:
    codec = _codec(request)
    return codec.decode(ids) if codec is not None else ""


def _completion(request: web.Request, rid: str, body: dict[str, Any], prompt: list[int],
                ids: list[int], finish: str | None, params: Any,
                cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
        "model": body.get("model") or request.app[STATE].settings.model_name,
        "choices": [{"index": 0, "text": _text(request, ids), "token_ids": ids,
                     "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                  "total_tokens": len(prompt) + len(ids),
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
        "kv_transfer_params": params,
    }


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await read_json(request)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise bad("kv_transfer_params: a pdd instance serves only vLLM's disaggregated "
                      "flow (do_remote_decode on a prefill, do_remote_prefill on a decode)")
        prompt = _prompt_ids(request, body)
        options = _options(body)
        if state.settings.role == "prefill":
            return await _prefill_leg(request, state, rid, body, prompt, params, options)
        return await _decode_leg(request, state, rid, body, prompt, params, options)
    except Exception as exc:
        return error_response(exc)


async def _prefill_leg(request: web.Request, state: InstanceState, rid: str,
                       body: dict[str, Any], prompt: list[int], params: dict[str, Any],
                       options: dict[str, Any]) -> web.Response:
    if params.get("do_remote_decode") is not True:
        raise bad("kv_transfer_params.do_remote_decode: a prefill instance needs true")
    seq, held = await run_prefill(request, state, {"request_id": rid, "prompt_ids": prompt,
                                                   **options})
    first = seq.output[0]
    out = vllm_params(state, held, first) if held else None
    return web.json_response(_completion(request, rid, body, prompt, [first],
                                         seq.finish_reason or "length", out,
                                         int(seq.extra.get(CACHED_TOKENS, 0))))


async def _decode_leg(request: web.Request, state: InstanceState, rid: str,
                      body: dict[str, Any], prompt: list[int], params: dict[str, Any],
                      options: dict[str, Any]) -> web.StreamResponse:
    if params.get("do_remote_prefill") is not True or not isinstance(params.get(GRANT), dict):
        raise bad("kv_transfer_params: a decode instance needs do_remote_prefill true and the "
                  f"prefill's {GRANT}")
    try:
        if params.get("remote_num_tokens") != len(prompt):
            raise bad(f"prompt: {len(prompt)} tokens, but the prefill ran "
                      f"{params.get('remote_num_tokens')!r}")
        key = _checked(token_limit, body) or "max_tokens"
        max_tokens = body.get(key, 16)
        if max_tokens < 1:
            raise bad(f"{key}: must be an integer >= 1, got {max_tokens!r}")
        first = params.get(FIRST_TOKEN)
        if isinstance(first, bool) or not isinstance(first, int):
            raise bad(f"kv_transfer_params.{FIRST_TOKEN}: must be a token id, got {first!r}")
        opts = body.get("stream_options")
        usage = opts is not None and _checked(include_usage, opts)
    except RequestError:
        await _give_back(request, state, params[GRANT])
        raise
    seq = await decode_sequence(request, state, {
        "request_id": rid, "first_token": first, "max_new_tokens": max_tokens - 1,
        "kv_transfer_params": params[GRANT], "prompt_ids": prompt, **options})
    if body.get("stream"):
        return await _stream(request, state, rid, body, seq, prompt, first, usage)
    await finished(request, state, seq)
    err = sequence_error(seq)
    if err:
        raise err
    return web.json_response(_completion(request, rid, body, prompt, [first, *seq.output],
                                         seq.finish_reason, None))


async def _give_back(request: web.Request, state: InstanceState, grant: Any) -> None:
    """A decode leg refused before its pull: the prefill's blocks go back now, not at the end
    of their lease (what the proxy strips from the prefill leg, and so only the decode leg can
    refuse, must not pin them). Only a prefill peer this decode found gets the grant."""
    watch = request.app[PEERS]
    try:
        src = TransferParams.from_grant(grant, state.worker.key, 0.0)
    except GRANT_ERRORS:
        return
    url = state.prefill_peers.get(src.instance_id)
    if url is None or watch.session is None:
        return
    try:
        async with watch.session.post(f"{url}/v1/release",
                                      json={"kv_transfer_params": grant}) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError):
        pass  # the lease frees them


async def _stream(request: web.Request, state: InstanceState, rid: str, body: dict[str, Any],
                  seq: Sequence, prompt: list[int], first: int,
                  usage: bool) -> web.StreamResponse:
    """``usage`` (stream_options.include_usage): ``"usage": null`` on every chunk, then one
    chunk of no choices with the counts, as OpenAI's stream ends."""
    tokens = sequence_tokens(request, state, seq)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    sent = 0

    def data(choices: list[dict[str, Any]], counts: dict[str, int] | None = None) -> bytes:
        out: dict[str, Any] = {
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or state.settings.model_name, "choices": choices}
        if usage:
            out["usage"] = counts
        return f"data: {json.dumps(out)}\n\n".encode()

    def chunk(ids: list[int], finish: str | None) -> bytes:
        nonlocal sent
        sent += len(ids)
        return data([{"index": 0, "text": _text(request, ids), "token_ids": ids,
                      "logprobs": None, "finish_reason": finish}])

    await response.prepare(request)
    try:
        await response.write(chunk([first], None))
        async for token in tokens:
            await response.write(chunk([token], None))
        err = sequence_error(seq)
        if err:
            payload = {"error": {"message": str(err), "type": err.kind, "code": err.status}}
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())
        else:
            await response.write(chunk([], seq.finish_reason))
            if usage:
                await response.write(data([], {"prompt_tokens": len(prompt),
                                               "completion_tokens": sent,
                                               "total_tokens": len(prompt) + sent}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        await tokens.aclose()
    return response


def add_routes(app: web.Application) -> None:
    app[_CODEC] = {}
    app.router.add_post("/v1/completions", completions)
