"""Decode instance API: pull the prompt's KV from a prefill instance, then decode in the running
batch.

`POST /v1/decode {"request_id", "first_token", "max_new_tokens", "kv_transfer_params",
"prompt_ids", "sampling", "stop_token_ids", "ignore_eos", "stream"}`: the request waits for KV
blocks if the instance is full (429 once the queue is), every rank reads exactly the chunks the
routing plan gives it while the batch keeps running (with `prompt_ids` and the prefix cache on,
only the tokens after those this decode already holds, whole units and the partial unit a
finished sequence left: a follow-up turn of a conversation it served pulls only its new
tokens), notifies the prefill ranks the plan names,
and the sequence joins the batch until a stop id, EOS or `max_new_tokens`. With
`"stream": true` the answer is NDJSON, one `{"token": id}` line per token (with `"logprobs": k`
also `"logprob": [logprob, rank, [[id, logprob] x k]]`, the raw distribution's) and a final
line with the totals (`cached_tokens`: the prompt tokens whose KV was not pulled); an error
before the first token is a plain HTTP error. A client that disconnects cancels its sequence. A
`sampling.repetition_penalty` needs `prompt_ids` (it penalizes the prompt's tokens too).

Several choices of one request (`n` > 1): `"choices": [[index, first_token], ...]` instead of
`first_token`, at most 16. The KV is pulled once, by the first choice's sequence, which then
forks into one per choice sharing the prompt's blocks (engine/scheduler.py); choice `index`
samples with `choice_seed(sampling.seed, index)`. The stream's token lines are then
`{"choice": index, "token": id}` (with `logprobs`, each carries its choice's `"logprob"`),
choices interleaved as their tokens come, and the final line lists each choice's `token_ids`,
`finish_reason` (and `logprobs`) under `choices`. `POST /v1/decode/end {"request_id",
"choice"}` ends one choice while the others run on (202; the router found a stop string in its
text, so what it would still generate is thrown away): its final finish reason is "stop".

Local prefill: `"local_prefill": true` with `prompt_ids` and no `kv_transfer_params` (nor
`first_token`, `choices`) runs the prompt on this decode itself, chunked in its own steps beside
the running batch and through its own prefix cache (engine/scheduler.py), each rank keeping its
DCP share as a prefill's rank would; the stream's first token line is then the first token, and
`max_new_tokens` counts the tokens after it as for a hand-off. The router sends a request here
when the part of its prompt this decode does not cache is short, or when no prefill is ready
(serve/router/prefill_path.py). One choice, no `prompt_logprobs`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pdd_sidecar import tracing
from pdd_sidecar.engine import timing
from pdd_sidecar.engine.sampling import MAX_CHOICES, choice_seed
from pdd_sidecar.engine.scheduler import (
    CACHED_TOKENS,
    FORKS,
    LOGPROBS,
    PENALTY_PROMPT,
    Fork,
    Sequence,
)
from pdd_sidecar.engine.worker import RequestError
from pdd_sidecar.grammar import GrammarError
from pdd_sidecar.kv.errors import GRANT_REFUSED, LEASE_EXPIRED
from pdd_sidecar.kv.grants import GRANT_MARGIN_S, GrantExpired
from pdd_sidecar.kv.handoff import DRAFT_STATE_DTYPES, TransferParams, parse_endpoints
from pdd_sidecar.kv.transfer import join_paths
from pdd_sidecar.serve.discovery import fresh_dns_connector, replicas
from pdd_sidecar.serve.instance import spans
from pdd_sidecar.serve.instance.common import (
    GRANT_ERRORS,
    STATE,
    InstanceState,
    RequestRecord,
    bad,
    choice_members,
    error_response,
    finished,
    first_error,
    grant_refusal,
    int_field,
    logprob_json,
    read_json,
    request_id,
    sequence_error,
    sequence_options,
    sequence_token_batches,
    token_ids,
)


def _claim_url(state: InstanceState, src: TransferParams) -> str:
    """The HTTP URL (for the claim) of the prefill peer that issued a verified grant.

    The decode reads only from prefill instances it discovered itself, never from a host a
    request names."""
    url = state.prefill_peers.get(src.instance_id)
    refused = state.peer_errors.get(src.instance_id)
    if url is None and refused is not None:
        raise refused  # a configured peer that failed its handshake: say why
    if url is None:
        raise RequestError(
            f"kv_transfer_params: instance {src.instance_id} is not a prefill peer of "
            f"this decode (known: {sorted(state.prefill_peers.values())})", 403, "forbidden")
    return url


def _check_draft_state(state: InstanceState, src: TransferParams) -> None:
    """A draft state of another model's width (its prefill serves another checkpoint) is
    refused here, naming the field, not found on the ranks in the middle of a step; a decode
    that drafts no MTP ignores the field (kv/handoff.py ``DraftState``)."""
    ds = src.draft_state
    if ds is None or state.worker.mtp is None:
        return
    values = len(ds.data) // DRAFT_STATE_DTYPES[ds.dtype]
    hidden = state.worker.model.config.hidden_size
    if values != hidden:
        raise bad(f"kv_transfer_params.draft_state.hidden: {values} values, this model's "
                  f"hidden size is {hidden}")


def _sequence(state: InstanceState, body: dict[str, Any], src: TransferParams) -> Sequence:
    claim_url = _claim_url(state, src)
    _check_draft_state(state, src)
    choices = _choices(state, body)
    first = choices[0][1]
    max_new = _max_new_tokens(state, body, src.num_tokens)
    prompt = _prompt_ids(state, body, src)
    options = sequence_options(state, body, first)
    penalizes_prompt = options["sampling"].repetition_penalty != 1.0
    if penalizes_prompt and not prompt:
        raise bad("prompt_ids: sampling.repetition_penalty looks at the prompt's tokens; send "
                  "the prompt's token ids")
    seq = Sequence(request_id(body, lambda: uuid.uuid4().hex),
                   prompt if state.settings.prefix_cache else [], max_new,
                   src.num_tokens + max_new, source=src, first_token=first, **options)
    drafts_from_prompt = state.driver.speculator is not None  # n-gram drafts look it up
    if (penalizes_prompt or drafts_from_prompt) and not state.settings.prefix_cache:
        seq.extra[PENALTY_PROMPT] = prompt
    seq.extra["source"] = src
    seq.extra["claim_url"] = claim_url
    if body.get("choices") is not None:
        base = seq.sampling
        seq.extra["choice"] = choices[0][0]
        seq.sampling = dataclasses.replace(base, seed=choice_seed(base.seed, choices[0][0]))
        if len(choices) > 1:
            seq.extra[FORKS] = [Fork(j, t, dataclasses.replace(
                base, seed=choice_seed(base.seed, j)), grammar=_grammar(state, base, t))
                for j, t in choices[1:]]
    return seq


def _max_new_tokens(state: InstanceState, body: dict[str, Any], prompt_tokens: int) -> int:
    """The tokens a request decodes after its first, refused (400) past the model's length."""
    max_new = int_field(body, "max_new_tokens", 16, 0)
    assert max_new is not None
    total = prompt_tokens + 1 + max_new
    if total > state.max_model_len:
        raise bad(f"max_new_tokens: prompt ({prompt_tokens} tokens) + 1 + max_new_tokens "
                  f"({max_new}) = {total} exceeds the maximum model length "
                  f"{state.max_model_len}")
    return max_new


def _grammar(state: InstanceState, sampling: Any, first: int) -> Any:
    """A forked choice's own matcher under the request's grammar, advanced by its first
    token (None without structured output)."""
    if sampling.structured is None:
        return None
    try:
        return state.grammars.start(sampling.structured, first)
    except GrammarError as exc:
        raise bad(f"choices: {exc}") from None


def _choices(state: InstanceState, body: dict[str, Any]) -> list[tuple[int, int]]:
    """``(choice index, first token)`` of each choice the request runs: its ``choices``, or
    choice 0 with its ``first_token``."""
    raw = body.get("choices")
    if raw is None:
        return [(0, token_ids(state, [body.get("first_token")], "first_token")[0])]
    if (not isinstance(raw, list) or not 0 < len(raw) <= MAX_CHOICES
            or not all(isinstance(c, list) and len(c) == 2 for c in raw)):
        raise bad(f"choices: must be a list of 1 to {MAX_CHOICES} [index, first_token] pairs")
    indices = [c[0] for c in raw]
    if (not all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < MAX_CHOICES
                for j in indices) or len(set(indices)) != len(indices)):
        raise bad(f"choices: indices must be distinct integers in [0, {MAX_CHOICES}), got "
                  f"{indices!r}")
    firsts = token_ids(state, [c[1] for c in raw], "choices")
    return list(zip(indices, firsts, strict=True))


def _prompt_ids(state: InstanceState, body: dict[str, Any], src: TransferParams) -> list[int]:
    """The prompt's token ids when the request names them (they key the prefix cache), else
    []: the whole prompt's KV is pulled."""
    if body.get("prompt_ids") is None:
        return []
    prompt = token_ids(state, body["prompt_ids"], "prompt_ids")
    if len(prompt) != src.num_tokens:
        raise bad(f"prompt_ids: {len(prompt)} token ids, but the grant holds the KV of "
                  f"{src.num_tokens} prompt tokens")
    return prompt


def _local_sequence(state: InstanceState, body: dict[str, Any]) -> Sequence:
    """A request whose prompt this decode prefills itself (module docstring)."""
    for key in ("kv_transfer_params", "first_token", "choices", "prompt_logprobs"):
        if body.get(key) is not None:
            raise bad(f"{key}: a local_prefill request runs its prompt here and takes no "
                      f"{key}, got {body[key]!r}")
    if body.get("prompt_ids") is None:
        raise bad("prompt_ids: a local_prefill request needs the prompt's token ids")
    prompt = token_ids(state, body["prompt_ids"], "prompt_ids")
    if not prompt:
        raise bad("prompt_ids: must hold at least one token id, got []")
    max_new = _max_new_tokens(state, body, len(prompt))
    # ``max_tokens`` counts the first token too: it is sampled here, into the output.
    return Sequence(request_id(body, lambda: uuid.uuid4().hex), prompt, max_new + 1,
                    len(prompt) + max_new, **sequence_options(state, body))


async def decode_sequence(request: web.Request, state: InstanceState,
                          body: dict[str, Any]) -> Sequence:
    """The sequence of a decode request body (RequestError on refusal). Its grant is parsed
    and verified here, once; the ranks get the typed parameters."""
    state.require_serving("decode")
    local = body.get("local_prefill", False)
    if not isinstance(local, bool):
        raise bad(f"local_prefill: must be a boolean, got {local!r}")
    if local:
        return _local_sequence(state, body)
    try:
        src = TransferParams.from_grant(body.get("kv_transfer_params"), state.worker.key,
                                        GRANT_MARGIN_S)
    except GRANT_ERRORS as exc:
        refusal = grant_refusal(exc)
        if refusal.status != 400:  # a grant refused, not a body that holds none
            state.metrics.handoff_failures.labels(
                role="decode", cause=LEASE_EXPIRED if isinstance(exc, GrantExpired)
                else GRANT_REFUSED).inc()
        raise refusal from None
    watch = request.app[PEERS]
    if watch.session is not None and src.instance_id not in state.prefill_peers:
        await watch.round()  # a prefill that restarted since the last round
    seq = _sequence(state, body, src)
    where = watch.endpoints.get(src.instance_id)
    if where is not None and where != src.endpoints:
        # A grant verifies only if a prefill of this deployment signed it; even so the READ
        # goes where discovery found that instance's ranks, never to a host the request names.
        state.metrics.handoff_failures.labels(role="decode", cause=GRANT_REFUSED).inc()
        raise RequestError(
            f"kv_transfer_params: names {_where(src.endpoints)} for the ranks of prefill "
            f"instance {src.instance_id}, which this decode found at {_where(where)}", 403,
            "forbidden")
    return seq


def _where(endpoints: list[tuple[str, int]]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in endpoints)


def info_endpoints(info: dict[str, Any]) -> list[tuple[str, int]]:
    """Each rank's side channel from a prefill's /v1/info (one pod: consecutive ports)."""
    tp = int(info["tp"])
    listed = info.get("rank_endpoints")
    if listed is None:
        return [(str(info["host"]), int(info["side_channel_port"]) + p) for p in range(tp)]
    return parse_endpoints(listed, tp)


def _summary(state: InstanceState, seq: Sequence) -> dict[str, Any]:
    m = state.metrics
    ranks = []
    for rank, t in sorted(seq.extra.get("transfer", {}).items()):
        if not t:
            continue
        m.transfer_bytes.labels(rank=str(rank)).inc(t["bytes"])
        m.transfer_descriptors.labels(rank=str(rank)).inc(t["descriptors"])
        m.transfer_seconds.labels(rank=str(rank)).observe(t["seconds"])
        if t.get("device_seconds"):
            m.transfer_device_seconds.labels(rank=str(rank)).inc(t["device_seconds"])
        m.transfer_paths.labels(path=t["path"]).inc()
        ranks.append({"rank": rank, **t})
    lp: dict[str, Any] = {"logprobs": logprob_json(seq.extra.get(LOGPROBS, []))} \
        if seq.logprobs is not None else {}
    out: dict[str, Any] = {
        **lp,
        "request_id": seq.id,
        "token_ids": seq.output,
        "finish_reason": seq.finish_reason,
        "cached_tokens": int(seq.extra.get(CACHED_TOKENS, 0)),
        "transfer": {
            "bytes": sum(r["bytes"] for r in ranks),
            "descriptors": sum(r["descriptors"] for r in ranks),
            "path": join_paths(r["path"] for r in ranks),
            "ranks": ranks,
        },
        "timing": timing.decode_timing(seq.extra, seq.source is None),
    }
    if "choice" in seq.extra:
        out["choices"] = [{"index": m.extra["choice"], "token_ids": m.output,
                           "finish_reason": m.finish_reason,
                           **({"logprobs": logprob_json(m.extra.get(LOGPROBS, []))}
                              if m.logprobs is not None else {})} for m in choice_members(seq)]
    return out


def _error(seq: Sequence) -> RequestError | None:
    """The request's error: its own, or that of a choice forked from it."""
    for m in choice_members(seq):
        err = sequence_error(m)
        if err:
            return err
    return None


async def decode(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    rec = RequestRecord(state.metrics, "decode")
    seq: Sequence | None = None
    try:
        body = await read_json(request)
        seq = await decode_sequence(request, state, body)
        seq.extra[timing.RECEIVED] = rec.start
        if body.get("stream"):
            response = await _stream(request, state, seq)
            rec.ok(response.status)
            return response
        await finished(request, state, seq)
        err = _error(seq)
        if err:
            raise err
        rec.ok()
        return web.json_response(_summary(state, seq))
    except Exception as exc:
        return rec.failed(exc)
    finally:
        if tracing.enabled():
            spans.decode(tracing.extract(request.headers), seq, rec.start, rec.status,
                         request.headers.get(tracing.HANDOFF_ATTEMPT_HEADER), rec.error)
        rec.close()


def _token_lines(tokens: list[int]) -> bytes:
    """``{"token": id}`` lines, as json.dumps writes them, without a dict and an encoder call
    per token (the loop writes one for each of a few hundred streams every step)."""
    return b"".join(b'{"token": %d}\n' % t for t in tokens)


def _lines(seq: Sequence, tokens: list[int], sent: int) -> bytes:
    """The lines of ``tokens``, the sequence's tokens from index ``sent`` on; a sequence that
    asked for log-probabilities sends each token's entry in its line (``"logprob"``: ``[logprob,
    rank, [[id, logprob], ...]]``), which the driver stored before it delivered the token."""
    if seq.logprobs is None:
        return _token_lines(tokens)
    entries = logprob_json(seq.extra[LOGPROBS][sent:sent + len(tokens)])
    return b"".join(json.dumps({"token": t, "logprob": e}).encode() + b"\n"
                    for t, e in zip(tokens, entries, strict=True))


def _choice_lines(seq: Sequence, tokens: list[tuple[int, int]], sent: dict[int, int]) -> bytes:
    """The lines of ``(choice, token)`` pairs; ``sent``: how many tokens of each choice went
    out before them (counted here). With log-probabilities each line carries its choice's
    entry, stored on that choice's sequence before the token was delivered."""
    if seq.logprobs is None:
        return b"".join(b'{"choice": %d, "token": %d}\n' % jt for jt in tokens)
    members = {m.extra["choice"]: m for m in choice_members(seq)}
    out = []
    for j, t in tokens:
        at = sent.get(j, 0)
        sent[j] = at + 1
        entry = logprob_json(members[j].extra[LOGPROBS][at:at + 1])[0]
        out.append(json.dumps({"choice": j, "token": t, "logprob": entry}).encode() + b"\n")
    return b"".join(out)


async def _stream(request: web.Request, state: InstanceState,
                  seq: Sequence) -> web.StreamResponse:
    batches = sequence_token_batches(request, state, seq)
    first = await anext(batches, None)
    err = _error(seq)
    if first is None and err:
        raise err  # nothing sent yet: a plain HTTP error
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    multi = "choice" in seq.extra
    each: dict[int, int] = {}  # n > 1: tokens of each choice sent
    try:
        if first is not None:
            head = first[0]
            if multi:
                head_line = _choice_lines(seq, first[:1], each)
                line: dict[str, Any] = json.loads(head_line)
            else:
                line = {"token": head}
                if seq.logprobs is not None:
                    line["logprob"] = logprob_json(seq.extra[LOGPROBS][:1])[0]
            line["timing"] = timing.decode_timing(seq.extra, seq.source is None)
            await response.write(json.dumps(line).encode() + b"\n" + (
                _choice_lines(seq, first[1:], each) if multi else _lines(seq, first[1:], 1)))
            sent = len(first)
            async for batch in batches:
                await response.write(_choice_lines(seq, batch, each) if multi
                                     else _lines(seq, batch, sent))
                sent += len(batch)
        err = _error(seq)
        if err:
            final: dict[str, Any] = {"error": {"message": str(err), "type": err.kind,
                                               "code": err.status}, "status": err.status}
        else:
            final = {"done": True, **_summary(state, seq)}
        await response.write(json.dumps(final).encode() + b"\n")
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        await batches.aclose()  # the client is gone: cancels the sequence
    return response


class PeerWatch:
    """The decode's view of its prefill peers: handshaken on every rank, by instance id."""

    def __init__(self, state: InstanceState) -> None:
        self.state = state
        self.done: set[str] = set()
        self.lock = asyncio.Lock()
        self.session: aiohttp.ClientSession | None = None
        self.endpoints: dict[str, list[tuple[str, int]]] = {}  # instance id -> its ranks

    async def round(self) -> list[str]:
        """Probe every configured prefill once; returns the problems of those never reached."""
        state = self.state
        s = state.settings
        assert self.session is not None
        async with self.lock:
            urls = await replicas(s.prefill_urls, s.prefill_service)
            problems = []
            for url in urls:
                try:
                    async with self.session.get(f"{url}/v1/info") as resp:
                        info = await resp.json()
                    if url in self.done and state.prefill_peers.get(info["instance_id"]) == url:
                        continue
                    endpoints = info_endpoints(info)
                    results = await state.call({
                        "op": "handshake", "rank_endpoints": [list(e) for e in endpoints],
                        "instance_id": info["instance_id"], "tp": info["tp"], "dcp": info["dcp"],
                    })
                    err = first_error(results)
                    if err:
                        state.peer_errors[str(info["instance_id"])] = err
                        raise err
                    state.peer_errors.pop(str(info["instance_id"]), None)
                    for old in [i for i, u in state.prefill_peers.items() if u == url]:
                        del state.prefill_peers[old]
                    state.prefill_peers[info["instance_id"]] = url
                    self.endpoints[info["instance_id"]] = endpoints
                    self.done.add(url)
                    state.peer_status[url] = "ok"
                except Exception as exc:
                    msg = str(exc) or type(exc).__name__
                    state.peer_status[url] = msg
                    if url not in self.done:
                        problems.append(f"{url}: {msg}")
            if s.prefill_urls:  # a fixed set: every one must answer
                state.peers_ready = bool(urls) and not problems
            elif s.prefill_service:  # a Service's pods come and go: one serving peer will do
                state.peers_ready = bool(state.prefill_peers) and len(problems) < len(urls)
            else:
                state.peers_ready = True
            if state.peers_ready:
                state.not_ready_reason = ""
            else:
                state.not_ready_reason = (
                    "prefill peers have not answered the handshake: " + "; ".join(problems)
                    if problems else "no prefill peers found"
                )
            return problems


PEERS = web.AppKey("peers", PeerWatch)


async def watch_prefill_peers(state: InstanceState, watch: PeerWatch) -> None:
    """Ready only once every configured prefill instance answered the handshake on all ranks.

    A peer that later dies does not make this instance unready (the router routes around it);
    an incompatible peer keeps it unready with the reason, since every request to it would fail.
    A grant from an instance not seen yet (a restarted prefill) triggers a round at once.
    """
    while not state.ranks_ready:
        await asyncio.sleep(0.2)
    timeout = aiohttp.ClientTimeout(total=state.settings.handshake_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=fresh_dns_connector()) as session:
        watch.session = session
        try:
            while True:
                await watch.round()
                await asyncio.sleep(1.0 if not state.peers_ready else 5.0)
        finally:
            watch.session = None


async def end_choice(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await read_json(request)
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise bad(f"request_id: must be a non-empty string, got {rid!r}")
        choice = int_field(body, "choice", None, 0)
        if choice is None or choice >= MAX_CHOICES:
            raise bad(f"choice: must be an integer from 0 to {MAX_CHOICES - 1}, got "
                      f"{body.get('choice')!r}")
        state.driver.end_choice(rid, choice)
        return web.json_response({"request_id": rid, "choice": choice}, status=202)
    except Exception as exc:
        return error_response(exc)


def add_routes(app: web.Application) -> None:
    app[PEERS] = PeerWatch(app[STATE])
    app.router.add_post("/v1/decode", decode)
    app.router.add_post("/v1/decode/end", end_choice)
