"""What the prefill and decode HTTP APIs share: the instance state, request parsing, errors in
OpenAI's shape, and waiting for a sequence while watching the client."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from pdd_sidecar import tracing
from pdd_sidecar.engine.driver import InstanceDriver, on_loop
from pdd_sidecar.engine.grammar_mask import Grammars
from pdd_sidecar.engine.sampling import MAX_LOGPROBS, Logprob, SamplingError, SamplingParams
from pdd_sidecar.engine.scheduler import FORKS, GROUP, Sequence
from pdd_sidecar.engine.worker import RankWorker, RequestError
from pdd_sidecar.grammar import GrammarError
from pdd_sidecar.kv.grants import GrantError, GrantExpired
from pdd_sidecar.kv.handoff import MalformedGrant
from pdd_sidecar.kv.pool_sizing import PoolSize
from pdd_sidecar.metrics import InstanceMetrics
from pdd_sidecar.model.generation import eos_token_ids

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
                413: "invalid_request_error", 429: "rate_limit_error"}


class InstanceState:
    """What rank 0's HTTP handlers share."""

    def __init__(self, worker: RankWorker, driver: InstanceDriver,
                 metrics: InstanceMetrics) -> None:
        self.worker = worker
        self.driver = driver
        self.metrics = metrics
        self.settings = worker.settings
        cfg = worker.model.config
        self.vocab_size = cfg.vocab_size
        self.max_model_len = self.settings.max_model_len or cfg.max_position_embeddings
        self.eos_ids = eos_token_ids(self.settings.model_source)
        self.grammars = Grammars(self.settings.model_source, self.vocab_size, self.eos_ids)
        self.ranks_ready = False
        self.peers_ready = self.settings.role == "prefill"
        self.not_ready_reason = ("starting: warming up (kernels, CUDA graphs), then every "
                                 "rank's side channel")
        self.peer_status: dict[str, str] = {}
        self.prefill_peers: dict[str, str] = {}  # instance id -> HTTP URL (decode)
        self.peer_errors: dict[str, RequestError] = {}  # instance id -> why it was refused
        self.draining = False
        self.in_flight = 0  # POST requests being answered (server.py counts them)
        self.clients = ClientWatch()

    @property
    def ready(self) -> bool:
        return (self.ranks_ready and self.peers_ready and self.driver.warm
                and not self.driver.fatal and not self.draining)

    def drain_and_exit(self, limit_s: float) -> None:
        """SIGTERM: stop taking work, let held KV be read and running requests finish, exit.

        Runs on its own thread; the pod's terminationGracePeriodSeconds bounds it anyway.
        """
        self.draining = True
        self.not_ready_reason = "draining: shutting down"
        log.info("draining before exit (at most %.0fs)", limit_s)
        deadline = time.monotonic() + limit_s
        # Idle twice in a row: a request accepted just before the drain may be between its
        # handler and the engine (a decode pulling KV), or its answer still being written.
        quiet = 0
        while time.monotonic() < deadline and quiet < 2:
            quiet = quiet + 1 if self.driver.idle() and self.in_flight == 0 else 0
            time.sleep(0.1)
        tracing.shutdown()  # the last requests' spans go out before the process does
        logging.shutdown()
        os._exit(0)

    async def call(self, cmd: dict[str, Any]) -> list[Any]:
        return await asyncio.wrap_future(self.driver.call(cmd))

    async def call_release(self, request_id: str) -> bool:
        return await asyncio.wrap_future(self.driver.release(request_id))

    def info(self) -> dict[str, Any]:
        s = self.settings
        return {
            "role": s.role,
            "replica": s.replica,
            "tp": s.tp,
            "dcp": s.dcp,
            "block_size": s.block_size,
            "host": s.pod_ip,
            "side_channel_port": s.side_channel_port,
            "rank_endpoints": [list(e) for e in self.worker.endpoints],
            "pods": s.group_size,
            "instance_id": self.worker.instance_id,
            "compat": self.worker.compat.to_dict(),
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "num_blocks": self.worker.pool.blocks,
            "kv_capacity_tokens": self.worker.pool.sequence_tokens,
            # The pool as sized at start (kv/pool_sizing.py), also on /metrics (pdd_kv_pool_*).
            "kv_pool": pool_info(self.worker.pool),
            "ready": self.ready,
        }

    def require_serving(self, role: str) -> None:
        if not self.ranks_ready or self.draining or (role == "prefill" and not self.ready):
            raise RequestError(f"not ready: {self.not_ready_reason}", 503, "not_ready")


STATE = web.AppKey("state", InstanceState)


def pool_info(pool: PoolSize) -> dict[str, Any]:
    return {"blocks": pool.blocks, "block_size": pool.block_size, "dcp": pool.dcp,
            "tokens": pool.tokens, "bytes_per_rank": pool.bytes,
            "reserved_blocks": pool.reserved, "longest_sequence_tokens": pool.longest,
            "sized_by": pool.source}


def error_response(exc: BaseException) -> web.Response:
    """OpenAI-style error JSON; a 5xx only for what is not the client's fault."""
    if isinstance(exc, RequestError):
        status, message, kind = exc.status, str(exc), exc.kind
    else:
        status, message, kind = 500, f"{type(exc).__name__}: {exc}", "internal_error"
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, kind),
                      "code": status, "kind": kind}}
    headers = {}
    if isinstance(exc, RequestError) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return web.json_response(body, status=status, headers=headers)


class RequestRecord:
    """One ``/v1/prefill`` or ``/v1/decode`` request's outcome, HTTP status and error, counted
    once in the instance's request metrics whatever happened (``close`` in a ``finally``) and
    read by its span."""

    def __init__(self, metrics: InstanceMetrics, role: str) -> None:
        self.metrics = metrics
        self.role = role
        self.start = time.monotonic()
        self.outcome = "error"
        self.status = 500
        self.error: str | None = None

    def ok(self, status: int = 200) -> None:
        self.outcome, self.status = "ok", status

    def failed(self, exc: BaseException) -> web.Response:
        """The OpenAI-style error answer for ``exc``, recorded."""
        response = error_response(exc)
        self.status, self.error = response.status, str(exc)
        return response

    def close(self) -> None:
        self.metrics.requests.labels(role=self.role, endpoint=self.role,
                                     outcome=self.outcome).inc()
        self.metrics.request_seconds.labels(role=self.role, endpoint=self.role).observe(
            time.monotonic() - self.start)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; whatever a client sends instead is its error (4xx): too big,
    not UTF-8, not JSON, an integer past Python's 4,300 digits, nesting past the recursion limit."""
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge as exc:
        raise RequestError(f"request body too large: {exc.text}", 413, "too_large") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        detail = str(exc)[:200] if not isinstance(exc, RecursionError) else "nested too deep"
        raise RequestError(f"request body must be JSON: {detail}", 400,
                           "invalid_request") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", 400, "invalid_request")
    return body


def choice_members(seq: Sequence) -> list[Sequence]:
    """The sequences of a request's choices (itself alone without forks)."""
    group = seq.extra.get(GROUP)
    return group.members if group is not None else [seq]


def first_error(results: list[Any]) -> RequestError | None:
    for r in results:
        if isinstance(r, dict) and r.get("error"):
            return RequestError.from_dict(r)
    return None


def bad(message: str) -> RequestError:
    return RequestError(message, 400, "invalid_request")


def grant_refusal(exc: ValueError) -> RequestError:
    """kv's verdict on a grant as the HTTP answer: not a grant 400, expired 410, not signed by
    this deployment 403."""
    if isinstance(exc, MalformedGrant):
        return bad(str(exc))
    if isinstance(exc, GrantExpired):
        return RequestError(str(exc), 410, "gone")
    return RequestError(str(exc), 403, "forbidden")


GRANT_ERRORS = (MalformedGrant, GrantError)


def int_field(body: dict[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key}: must be an integer, got {value!r}")
    if value < minimum:
        raise bad(f"{key}: must be >= {minimum}, got {value}")
    return value


def token_ids(state: InstanceState, value: Any, key: str, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise bad(f"{key}: must be a non-empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < state.vocab_size:
            raise bad(f"{key}: token id {t!r} is not in the vocabulary [0, {state.vocab_size})")
    return list(value)


def sequence_options(state: InstanceState, body: dict[str, Any],
                     first_token: int | None = None) -> dict[str, Any]:
    """Sampling and stop settings shared by prefill and decode requests; a sequence under a
    grammar gets its matcher (a decode's advanced by the prefill's ``first_token``)."""
    try:
        sampling = SamplingParams.parse(body.get("sampling"), state.vocab_size)
    except SamplingError as exc:
        raise bad(str(exc)) from None
    grammar = None
    if sampling.structured is not None:
        try:
            grammar = state.grammars.start(sampling.structured, first_token)
        except GrammarError as exc:
            raise bad(f"sampling.structured: {exc}") from None
    stops = set(token_ids(state, body.get("stop_token_ids") or [], "stop_token_ids", True))
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad(f"ignore_eos: must be a boolean, got {ignore_eos!r}")
    if not ignore_eos:
        stops |= state.eos_ids
    return {"sampling": sampling, "stop_ids": frozenset(stops), "grammar": grammar,
            "logprobs": logprobs_field(body, "logprobs")}


def logprobs_field(body: dict[str, Any], key: str) -> int | None:
    """A top count of log-probabilities in [0, MAX_LOGPROBS]; absent or null: none asked."""
    value = int_field(body, key, None, 0)
    if value is not None and value > MAX_LOGPROBS:
        raise bad(f"{key}: must be at most {MAX_LOGPROBS}, got {value}")
    return value


def logprob_json(entries: list[Logprob]) -> list[list[Any]]:
    """Log-probability entries as the instance APIs send them: ``[logprob, rank, [[id,
    logprob], ...]]`` each."""
    return [[lp, rank, [[t, v] for t, v in top]] for lp, rank, top in entries]


def request_id(body: dict[str, Any], make: Callable[[], str]) -> str:
    rid = body.get("request_id")
    if rid is None or rid == "":
        return make()
    if not isinstance(rid, str) or len(rid) > 256:
        raise bad("request_id: must be a string of at most 256 characters")
    try:
        rid.encode("utf-8")  # it travels in NIXL notifications as UTF-8
    except UnicodeEncodeError:
        raise bad("request_id: contains an unpaired surrogate, not valid Unicode text") from None
    return rid


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class ClientWatch:
    """The requests whose client may go away while their sequence runs, looked at together
    every ``interval_s`` by one task: a timer per sequence would wake the loop thousands of
    times a second under load, and delay what else it answers (the probes)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._watched: dict[int, tuple[web.Request, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def add(self, request: web.Request, on_gone: Callable[[], None]) -> int:
        """Call ``on_gone`` once, when the request's client is gone; the key removes it."""
        key = next(self._keys)
        self._watched[key] = (request, on_gone)
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run())
        return key

    def discard(self, key: int) -> None:
        self._watched.pop(key, None)

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(self.interval_s)
            gone = [k for k, (request, _) in self._watched.items() if client_gone(request)]
            for key in gone:
                _, on_gone = self._watched.pop(key)
                on_gone()


async def finished(request: web.Request, state: InstanceState, seq: Sequence) -> Sequence:
    """Submit ``seq`` and wait for it to finish; a client that goes away cancels it.

    The sequences a step finishes wake the loop once between them (``on_loop``), not once each:
    a prefill step of 64 prompts ends 64 requests at the same moment."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def end() -> None:
        if not ended.done():  # cancelled meanwhile: nobody waits
            ended.set_result(None)

    deliver = on_loop(loop, end)
    result = state.driver.submit(seq)
    result.add_done_callback(lambda _: deliver())
    key = state.clients.add(request, lambda: state.driver.cancel(seq.id))
    try:
        await asyncio.wait({ended})
    finally:
        state.clients.discard(key)
    return result.result()


async def sequence_token_batches(request: web.Request, state: InstanceState,
                                 seq: Sequence) -> AsyncGenerator[list[Any], None]:
    """Submit ``seq`` and yield its tokens as the engine chooses them, every token delivered
    so far at once (one write for them, when the loop fell behind); leaving early (a client
    gone, a failed write) cancels the sequence. Check ``sequence_error`` once it ends.

    A sequence of one of several choices (``seq.extra["choice"]``) yields ``(choice, token)``
    pairs instead, those of the choices forked from it too."""
    tokens: asyncio.Queue[Any] = asyncio.Queue()  # None: the sequence ended
    put = on_loop(asyncio.get_running_loop(), tokens.put_nowait)
    if "choice" in seq.extra:
        seq.on_token = functools.partial(_tagged, put, seq.extra["choice"])
        seq.extra[FORKS] = [f._replace(on_token=functools.partial(_tagged, put, f.choice))
                            for f in seq.extra.get(FORKS, ())]
    else:
        seq.on_token = put
    done = asyncio.ensure_future(finished(request, state, seq))
    done.add_done_callback(lambda _: tokens.put_nowait(None))
    try:
        ended = False
        while not ended:
            item = await tokens.get()
            batch: list[int] = []
            while True:
                if item is None:
                    ended = True
                    break
                batch.append(item)
                if tokens.empty():
                    break
                item = tokens.get_nowait()
            if batch:
                yield batch
        done.result()  # a refusal at submission (429, 400) raises here
        rest = [t for t in (tokens.get_nowait() for _ in range(tokens.qsize())) if t is not None]
        if rest:
            yield rest
    finally:
        if not done.done():
            state.driver.cancel(seq.id)
            await done


def _tagged(put: Callable[[Any], None], choice: int, token: int) -> None:
    put((choice, token))


async def sequence_tokens(request: web.Request, state: InstanceState,
                          seq: Sequence) -> AsyncGenerator[int, None]:
    """``sequence_token_batches`` one token at a time."""
    batches = sequence_token_batches(request, state, seq)
    try:
        async for batch in batches:
            for token in batch:
                yield token
    finally:
        await batches.aclose()


def sequence_error(seq: Sequence) -> RequestError | None:
    if seq.error:
        return RequestError.from_dict(seq.error)
    if seq.finish_reason == "cancelled":
        return RequestError("request cancelled", 499, "cancelled")
    return None
