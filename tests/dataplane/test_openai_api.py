"""The router's OpenAI API: formats, chat template vs transformers, stops, errors, cancellation.

Most tests put the router in front of a scripted instance (a small aiohttp app speaking the
instance API) so stops, upstream errors and disconnects are deterministic and fast; the last
test runs the real stack (prefill and decode instances of the built-in model). The transformers
oracle (apply_chat_template, tokenization, decode) is why this file is in the dataplane tier.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from runtime_fixtures import LocalCluster, free_ports, http
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.router.router import build_app

pytestmark = pytest.mark.dataplane

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
# DeepSeek-V2-Chat's template (bos, system/user/assistant turns, generation prompt).
DEEPSEEK_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'Assistant:' }}{% endif %}"
)
CORPUS = ["User: Hello world, this is a test. Assistant: Sure! héllo ünïcode 日本語 🙂 "
          "The quick brown fox jumps over the lazy dog. STOP here.\n\n"] * 40


# ---------------------------------------------------------------- a scripted instance
def fake_entry(token: int, k: int) -> list[Any]:
    """A log-probability entry as instances send it: the token's, and k others (the token
    itself among them, likeliest first)."""
    lp = -0.25 - (token % 7) / 8
    top = [[token, lp]] + [[(token + j) % 256, lp - j] for j in range(1, k)]
    return [lp, 1, top[:k]]


@dataclass
class Script:
    """What the fake instance answers; tests change it between requests."""

    first: int = ord("H")
    tokens: list[int] = field(default_factory=lambda: list(b"ello world. STOP and more"))
    delay_s: float = 0.0
    v2: bool = True  # False: the pre-v2 format (no finish_reason, errors as plain strings)
    prefill_status: int = 200
    prefill_error: Any = None
    retry_after: str | None = None
    decode_status: int = 200
    prefill_delay_s: float = 0.0
    fail_after: int | None = None  # decode: a transfer error line after this many tokens
    cached_tokens: int | None = None  # prefill: None answers without the field (older ones)
    split_bytes: int | None = None  # decode: the stream written in pieces of this many bytes
    decode_gate: threading.Event | None = None  # decode: answers nothing until it is set
    kv_capacity_tokens: int | None = None  # /readyz: KV tokens a sequence can hold (None: unsaid)


class FakeInstance:
    """Both roles on one port, recording what the router sent."""

    def __init__(self) -> None:
        self.script = Script()
        self.prefills: list[dict[str, Any]] = []
        self.decodes: list[dict[str, Any]] = []
        self.releases: list[str] = []
        self.cancelled: list[str] = []
        self.url = ""

    def reset(self, **changes: Any) -> None:
        self.script = Script(**changes)
        self.prefills.clear()
        self.decodes.clear()
        self.releases.clear()
        self.cancelled.clear()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/readyz", self.readyz)
        app.router.add_post("/v1/prefill", self.prefill)
        app.router.add_post("/v1/release", self.release)
        app.router.add_post("/v1/decode", self.decode)
        return app

    async def readyz(self, request: web.Request) -> web.Response:
        capacity = self.script.kv_capacity_tokens
        return web.json_response({"ready": True} if capacity is None
                                 else {"ready": True, "kv_capacity_tokens": capacity})

    def _error(self, status: int, message: str) -> web.Response:
        s = self.script
        body: Any = ({"error": {"message": message, "type": "invalid_request_error",
                                "code": status}} if s.v2 else {"error": message, "kind": "x"})
        headers = {"Retry-After": s.retry_after} if s.retry_after else {}
        return web.json_response(body, status=status, headers=headers)

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prefills.append(body)
        s = self.script
        if s.prefill_delay_s:
            try:
                await asyncio.sleep(s.prefill_delay_s)
            except asyncio.CancelledError:
                self.cancelled.append(body["request_id"])  # the router hung up on it
                raise
        if s.prefill_status != 200:
            return self._error(s.prefill_status, s.prefill_error or "refused")
        answer: dict[str, Any] = {"request_id": body["request_id"], "first_token": s.first,
                                  "kv_transfer_params": {"fake": True}}
        if s.v2:
            stops = set(body.get("stop_token_ids", []))
            answer["finish_reason"] = (
                "stop" if s.first in stops else "length" if body["max_tokens"] <= 1 else None)
            if answer["finish_reason"]:
                answer["kv_transfer_params"] = None
        if s.cached_tokens is not None:
            answer["cached_tokens"] = s.cached_tokens
        if body.get("logprobs") is not None:
            answer["logprobs"] = [fake_entry(s.first, body["logprobs"])]
        if body.get("prompt_logprobs") is not None:
            answer["prompt_logprobs"] = [fake_entry(t, body["prompt_logprobs"])
                                         for t in body["prompt_ids"][1:]]
        return web.json_response(answer)

    async def release(self, request: web.Request) -> web.Response:
        rid = (await request.json())["request_id"]
        # The fake outlives a test; a release the router sends in the background after the
        # previous test ended is that test's, not this one's.
        if any(p["request_id"] == rid for p in self.prefills):
            self.releases.append(rid)
        return web.json_response({"released": True})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.decodes.append(body)
        s = self.script
        while s.decode_gate is not None and not s.decode_gate.is_set():
            await asyncio.sleep(0.01)
        if s.decode_status != 200:
            return self._error(s.decode_status, "decode refused")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        if s.split_bytes:
            return await self._decode_in_pieces(body, response, s.split_bytes)
        sent: list[int] = []
        finish = "length"
        try:
            for tok in s.tokens[:body["max_new_tokens"]]:
                if s.fail_after is not None and len(sent) == s.fail_after:
                    err = {"message": "NIXL READ failed", "type": "server_error", "code": 502}
                    await response.write(json.dumps(
                        {"error": err if s.v2 else err["message"], "status": 502}).encode())
                    await response.write_eof()
                    return response
                if s.delay_s:
                    await asyncio.sleep(s.delay_s)
                line: dict[str, Any] = {"token": tok}
                if body.get("logprobs") is not None:
                    line["logprob"] = fake_entry(tok, body["logprobs"])
                await response.write(json.dumps(line).encode() + b"\n")
                sent.append(tok)
                if s.v2 and tok in body.get("stop_token_ids", []):
                    finish = "stop"
                    break
            final: dict[str, Any] = {"done": True, "token_ids": sent,
                                     "transfer": {"bytes": 1, "descriptors": 1, "ranks": []}}
            if s.v2:
                final["finish_reason"] = finish
            await response.write(json.dumps(final).encode() + b"\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(body["request_id"])
            raise
        return response


    async def _decode_in_pieces(self, body: dict[str, Any], response: web.StreamResponse,
                                size: int) -> web.StreamResponse:
        """The whole stream at once, cut without regard to its lines: lines split across
        reads, several in one read."""
        sent = self.script.tokens[:body["max_new_tokens"]]
        lines = [{"token": sent[0], "timing": {"queue": 1.5}}, *({"token": t} for t in sent[1:]),
                 {"done": True, "token_ids": sent, "finish_reason": "length",
                  "transfer": {"bytes": 1, "descriptors": 1, "ranks": []}}]
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        for i in range(0, len(data), size):
            await response.write(data[i:i + size])
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response


class Loop:
    """An event loop on a thread, for servers the test talks to over real sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application) -> str:
        async def start() -> str:
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            port = free_ports(1)
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)
            return f"http://127.0.0.1:{port}"

        return str(self.run(start()))

    def close(self) -> None:
        for runner in reversed(self.runners):
            self.run(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Stack:
    loop: Loop
    fakes: list[FakeInstance]
    routers: dict[str, str]

    @property
    def fake(self) -> FakeInstance:
        return self.fakes[0]


def _hf_dir(path: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(path / "tokenizer.json"))
    added = {"__type": "AddedToken", "lstrip": False, "normalized": True, "rstrip": False,
             "single_word": False}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": {**added, "content": BOS}, "eos_token": {**added, "content": EOS},
        "pad_token": {**added, "content": EOS}, "unk_token": None,
        "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 16384,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": DEEPSEEK_TEMPLATE,
    }))
    (path / "config.json").write_text(json.dumps({
        "vocab_size": 420, "max_position_embeddings": 512, "eos_token_id": 1,
        "bos_token_id": 0}))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hf_dir(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def stack(hf_dir: Path) -> Iterator[Stack]:
    loop = Loop()
    try:
        fakes = [FakeInstance(), FakeInstance()]
        for f in fakes:
            f.url = loop.serve(f.app())

        def router(source: str, prefill: list[FakeInstance], **extra: str) -> str:
            env = {"PDD_PREFILL_URLS": ",".join(f.url for f in prefill),
                   "PDD_DECODE_URLS": fakes[0].url, "PDD_MODEL_NAME": "served",
                   "PDD_MODEL_SOURCE": source, "PDD_ROUTER_HEALTH_INTERVAL_S": "0.2",
                   "PDD_ROUTER_MAX_BODY_BYTES": "65536",
                   # The fakes script the prefill -> decode protocol: every request through it.
                   "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "0", **extra}
            settings = RouterSettings.from_env(env)
            return loop.serve(build_app(settings))

        routers = {"builtin": router("builtin", fakes[:1]),
                   "hf": router(str(hf_dir), fakes[:1]),
                   "two": router("builtin", fakes),
                   "short": router("builtin", fakes[:1], PDD_MAX_MODEL_LEN="40"),
                   "narrow": router("builtin", fakes[:1], PDD_ROUTER_MAX_CONCURRENCY="3")}
        yield Stack(loop, fakes, routers)
    finally:
        loop.close()


@pytest.fixture
def fake(stack: Stack) -> FakeInstance:
    for f in stack.fakes:
        f.reset()
    return stack.fake


def _post(url: str, body: Any, timeout: float = 30) -> tuple[int, Any]:
    return http("POST", url, body, timeout=timeout)


def _sse(url: str, body: dict[str, Any]) -> tuple[int, list[Any], dict[str, str]]:
    """Every `data:` payload of a streamed answer (JSON, or the literal [DONE])."""
    u = urllib.parse.urlparse(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    headers = {k: v for k, v in resp.getheaders()}
    raw = resp.read().decode()
    conn.close()
    if resp.status != 200:
        return resp.status, [json.loads(raw)], headers
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return resp.status, events, headers


def _wait(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


# ---------------------------------------------------------------- formats
def test_models_lists_the_served_model(stack: Stack) -> None:
    status, body = http("GET", f"{stack.routers['hf']}/v1/models")
    assert status == 200 and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["served"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 512
    status, card = http("GET", f"{stack.routers['hf']}/v1/models/served")
    assert status == 200 and card == body["data"][0]
    status, card = http("GET", f"{stack.routers['hf']}/v1/models/org/other")
    assert status == 404 and card["error"]["param"] == "model"


def test_models_reports_the_length_the_instances_hold(stack: Stack) -> None:
    """An instance whose pool holds fewer tokens than the model's limit lowers the
    max_model_len /v1/models reports (one more than it holds: the last generated token is
    never fed back); a chat that sets no max_tokens runs up to it; a longer prompt is a 400."""
    small = FakeInstance()
    small.url = stack.loop.serve(small.app())
    small.script.kv_capacity_tokens = 100
    env = {"PDD_PREFILL_URLS": small.url, "PDD_DECODE_URLS": small.url,
           "PDD_MODEL_NAME": "served", "PDD_MODEL_SOURCE": "builtin",
           "PDD_ROUTER_HEALTH_INTERVAL_S": "0.2", "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "0"}
    router = stack.loop.serve(build_app(RouterSettings.from_env(env)))
    status, body = http("GET", f"{router}/v1/models")
    assert status == 200 and body["data"][0]["max_model_len"] == 101, body
    status, card = http("GET", f"{router}/v1/models/served")
    assert status == 200 and card["max_model_len"] == 101
    status, out = _post(f"{router}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, out
    (dec,) = [d for d in small.decodes if d["request_id"] == out["id"]]  # not the warm trip's
    prompt = out["usage"]["prompt_tokens"]
    assert dec["max_new_tokens"] == 101 - prompt - 1  # the prefill's token is the first
    status, err = _post(f"{router}/v1/completions", {"prompt": [5] * 101, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == "prompt", err
    assert "hold at most 100 tokens of KV" in err["error"]["message"], err
    small.script.kv_capacity_tokens = 50  # a smaller pool after a restart: seen at a probe
    assert _wait(lambda: http("GET", f"{router}/v1/models")[1]["data"][0]["max_model_len"]
                 == 51)


def test_completion_sends_the_instance_api_and_answers_openai(stack: Stack,
                                                              fake: FakeInstance) -> None:
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": "Hi there", "max_tokens": 6, "temperature": 0.5,
                          "top_p": 0.9, "top_k": 5, "seed": 42, "stop_token_ids": [7],
                          "ignore_eos": True})
    assert status == 200, body
    pre, dec = fake.prefills[0], fake.decodes[0]
    assert pre["prompt_ids"] == list(b"Hi there") and pre["max_tokens"] == 6
    assert pre["sampling"] == {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 42}
    assert pre["stop_token_ids"] == [7] and pre["ignore_eos"] is True
    assert dec["max_new_tokens"] == 5 and dec["stream"] is True
    assert dec["sampling"] == pre["sampling"] and dec["request_id"] == pre["request_id"]
    assert dec["kv_transfer_params"] == {"fake": True}
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "served"
    assert choice["token_ids"] == list(b"Hello ") and choice["text"] == "Hello "
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 6, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert fake.releases == [] and fake.cancelled == []
    # No seed given: the router draws one, a different one each time.
    for _ in range(2):
        assert _post(f"{stack.routers['builtin']}/v1/completions",
                     {"prompt": [1, 2], "max_tokens": 2})[0] == 200
    seeds = [p["sampling"]["seed"] for p in fake.prefills[1:]]
    assert len(set(seeds)) == 2 and all(isinstance(s, int) for s in seeds)
    assert fake.prefills[1]["sampling"]["temperature"] == 1.0


def test_chat_renders_the_template_as_transformers_does(stack: Stack, fake: FakeInstance,
                                                        hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(hf_dir))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello 日本語 world"},
                {"role": "assistant", "content": "Sure! héllo"},
                {"role": "user", "content": [{"type": "text", "text": "The quick"},
                                             {"type": "text", "text": "brown fox 🙂"}]}]
    flat = [dict(m, content=m["content"] if isinstance(m["content"], str)
                 else "\n".join(p["text"] for p in m["content"])) for m in messages]
    want = list(oracle.apply_chat_template(flat, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
    assert oracle.convert_ids_to_tokens(want[:1]) == [BOS]  # once, from the template
    answer = oracle.encode(" The lazy dog. STOP here.", add_special_tokens=False)
    fake.script.first, fake.script.tokens = answer[0], answer[1:]
    status, body = _post(f"{stack.routers['hf']}/v1/chat/completions",
                         {"messages": messages, "max_tokens": 40, "model": "served"})
    assert status == 200, body
    assert fake.prefills[0]["prompt_ids"] == want
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant",
                                 "content": oracle.decode(answer, skip_special_tokens=True)}
    assert choice["token_ids"] == answer
    assert body["usage"]["prompt_tokens"] == len(want)
    # A text prompt is tokenized as transformers' tokenizer(prompt) does (bos added).
    status, body = _post(f"{stack.routers['hf']}/v1/completions",
                         {"prompt": "The quick brown fox", "max_tokens": 3})
    assert status == 200, body
    assert fake.prefills[1]["prompt_ids"] == oracle("The quick brown fox")["input_ids"]
    assert body["choices"][0]["text"] == oracle.decode(answer[:3], skip_special_tokens=True)


def test_eos_of_the_checkpoint_stops_and_is_not_shown(stack: Stack, fake: FakeInstance) -> None:
    fake.reset(v2=False, first=300, tokens=[301, 302, 1, 303, 304])
    status, body = _post(f"{stack.routers['hf']}/v1/completions",
                         {"prompt": [5, 6], "max_tokens": 10})
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == [300, 301, 302, 1]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert _wait(lambda: fake.releases == [fake.prefills[0]["request_id"]])
    fake.reset(v2=False, first=300, tokens=[301, 302, 1, 303, 304])
    status, body = _post(f"{stack.routers['hf']}/v1/completions",
                         {"prompt": [5, 6], "max_tokens": 10, "ignore_eos": True})
    assert body["choices"][0]["token_ids"] == [300, 301, 302, 1, 303, 304]
    assert body["choices"][0]["finish_reason"] == "length"  # pre-v2: ran out of tokens


def test_stop_string_truncates_and_closes_the_decode(stack: Stack, fake: FakeInstance) -> None:
    fake.script.tokens = list(b"ello world. STOP and more, much more, ") * 5
    fake.script.delay_s = 0.01
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": "x", "max_tokens": 150, "stop": ["STOP", "nothing"]})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == "Hello world. " and choice["finish_reason"] == "stop"
    assert bytes(choice["token_ids"]) == b"Hello world. STOP"
    rid = fake.prefills[0]["request_id"]
    assert _wait(lambda: fake.cancelled == [rid] and fake.releases == [rid])


def test_streamed_completion_chunks(stack: Stack, fake: FakeInstance) -> None:
    status, events, headers = _sse(f"{stack.routers['builtin']}/v1/completions",
                                   {"prompt": "x", "max_tokens": 40, "stream": True,
                                    "stop": "STOP"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == "served" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "Hello world. "
    assert not any("S" in t for t in texts)  # "S", "ST", "STO" were held back, then dropped
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [
        "stop"]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert bytes(tokens) == b"Hello world. STOP"


@pytest.mark.parametrize("split_bytes", [1, 7, 4096])
def test_decode_stream_read_in_any_pieces(stack: Stack, fake: FakeInstance,
                                          split_bytes: int) -> None:
    """However the decode's lines arrive (a byte at a time, split mid-line, all in one read),
    the client gets one event per token, in order, and the stream's end."""
    want = fake.script.tokens[:11]
    fake.script.split_bytes = split_bytes
    status, events, _ = _sse(f"{stack.routers['builtin']}/v1/completions",
                             {"prompt": "x", "max_tokens": 12, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[fake.script.first]] + [
        [t] for t in want]
    assert "".join(c["choices"][0]["text"] for c in chunks) == bytes(
        [fake.script.first, *want]).decode()
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 11 + ["length"]
    assert chunks[-1]["pdd"]["timing"]["decode_queue"] == 1.5  # the first line's timing
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": "x", "max_tokens": 12})
    assert status == 200 and body["choices"][0]["token_ids"] == [fake.script.first, *want]
    assert body["pdd"]["transfer"] == {"bytes": 1, "descriptors": 1, "ranks": []}


def test_streamed_chat_chunks_start_with_the_role(stack: Stack, fake: FakeInstance) -> None:
    fake.script.cached_tokens = 16
    status, events, _ = _sse(f"{stack.routers['builtin']}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                              "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == "Hello"
    assert body[-1]["choices"][0]["finish_reason"] == "length"
    assert all("role" not in c["choices"][0]["delta"] for c in body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": len(fake.prefills[0]["prompt_ids"]), "completion_tokens": 5,
        "total_tokens": len(fake.prefills[0]["prompt_ids"]) + 5,
        "prompt_tokens_details": {"cached_tokens": 16}}
    assert fake.prefills[0]["prompt_ids"] == list(b"User: hi\n\nAssistant:")


def test_first_token_finishing_skips_the_decode(stack: Stack, fake: FakeInstance) -> None:
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": [1], "max_tokens": 1})
    assert status == 200 and body["choices"][0]["token_ids"] == [ord("H")]
    assert body["choices"][0]["finish_reason"] == "length" and body["pdd"]["decode"] is None
    assert fake.decodes == [] and fake.releases == []  # a v2 prefill freed it already
    fake.reset(v2=False)
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": [1], "max_tokens": 1})
    assert status == 200 and fake.decodes == []
    assert _wait(lambda: fake.releases == [fake.prefills[0]["request_id"]])  # pre-v2 held it
    fake.reset()
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": [1], "max_tokens": 9, "stop_token_ids": [ord("H")]})
    assert body["choices"][0]["finish_reason"] == "stop" and fake.decodes == []


# ---------------------------------------------------------------- errors
def test_upstream_4xx_passes_through_without_retry(stack: Stack, fake: FakeInstance) -> None:
    for f in stack.fakes:
        f.reset(prefill_status=429, prefill_error="queue full", retry_after="3")
    status, body, headers = _sse(f"{stack.routers['two']}/v1/completions",
                                 {"prompt": [1], "max_tokens": 3})
    assert status == 429 and headers.get("Retry-After") == "3"
    assert body[0]["error"]["message"] == "queue full"
    assert sum(len(f.prefills) for f in stack.fakes) == 1
    for f in stack.fakes:
        f.reset(prefill_status=400, prefill_error="prompt too long for the KV cache", v2=False)
    status, body = _post(f"{stack.routers['two']}/v1/completions", {"prompt": [1]})
    assert status == 400 and "KV cache" in body["error"]["message"]
    assert sum(len(f.prefills) for f in stack.fakes) == 1


def test_upstream_5xx_is_retried_on_another_prefill(stack: Stack, fake: FakeInstance) -> None:
    stack.fakes[0].reset(prefill_status=503, prefill_error="not ready")
    stack.fakes[1].reset(prefill_status=503, prefill_error="not ready")
    status, body = _post(f"{stack.routers['two']}/v1/completions", {"prompt": [1]})
    assert status == 503 and sum(len(f.prefills) for f in stack.fakes) == 2
    stack.fakes[1].reset()
    ok = [_post(f"{stack.routers['two']}/v1/completions", {"prompt": [1], "max_tokens": 2})
          for _ in range(2)]
    assert [s for s, _ in ok] == [200, 200]


def test_decode_refusal_releases_the_prefill(stack: Stack, fake: FakeInstance) -> None:
    """A decode's full queue: a whole answer is the 429 (Retry-After kept); a stream already
    has the prefill's token, so the refusal is its error event. The prefill's blocks go back
    either way."""
    fake.reset(decode_status=429, retry_after="1")
    status, answer = _post(f"{stack.routers['builtin']}/v1/completions",
                           {"prompt": [1], "max_tokens": 4})
    assert status == 429 and "decode refused" in answer["error"]["message"], answer
    assert _wait(lambda: fake.releases == [fake.prefills[0]["request_id"]])
    fake.reset(decode_status=429, retry_after="1")
    status, events, _ = _sse(f"{stack.routers['builtin']}/v1/completions",
                             {"prompt": [1], "max_tokens": 4, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["token_ids"] == [fake.script.first]
    assert events[-2]["error"]["code"] is None and "decode refused" in events[-2]["error"][
        "message"], events
    assert _wait(lambda: fake.releases == [fake.prefills[0]["request_id"]])


def test_the_first_token_streams_while_the_hand_off_runs(stack: Stack,
                                                       fake: FakeInstance) -> None:
    """The prefill's token reaches the client before the decode has answered anything (here
    it answers only once the client holds that token); the rest follows from the decode."""
    gate = threading.Event()
    fake.reset(decode_gate=gate)
    u = urllib.parse.urlparse(stack.routers["builtin"])
    conn = HTTPConnection(u.hostname, u.port, timeout=20)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": [1], "max_tokens": 3, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        line = resp.readline()  # blocks until the router writes: before the gate opens
        assert not gate.is_set() and line.startswith(b"data: "), line
        first = json.loads(line[len(b"data: "):])
        assert first["choices"][0]["token_ids"] == [fake.script.first]
        assert _wait(lambda: len(fake.decodes) == 1)  # the hand-off began meanwhile
        gate.set()
        rest = resp.read().decode()
    finally:
        gate.set()
        conn.close()
    events = [json.loads(b.strip()[len("data: "):]) for b in rest.split("\n\n")
              if b.strip().startswith("data: {")]
    tokens = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert tokens == list(b"el") and rest.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("v2", [True, False])
def test_decode_failing_mid_stream(stack: Stack, fake: FakeInstance, v2: bool) -> None:
    fake.reset(fail_after=3, v2=v2)
    status, body = _post(f"{stack.routers['builtin']}/v1/completions",
                         {"prompt": [1], "max_tokens": 10})
    assert status == 502 and "NIXL READ failed" in body["error"]["message"]
    assert body["error"]["type"] == "server_error"
    assert _wait(lambda: fake.releases == [fake.prefills[0]["request_id"]])
    fake.reset(fail_after=3, v2=v2)
    status, events, _ = _sse(f"{stack.routers['builtin']}/v1/completions",
                             {"prompt": [1], "max_tokens": 10, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert [t for e in events[:-2] for t in e["choices"][0]["token_ids"]] == list(b"Hell")
    assert "NIXL READ failed" in events[-2]["error"]["message"]


BAD = [
    ("completions", {"prompt": [1], "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": [1], "temperature": 3}, "temperature"),
    ("completions", {"prompt": [1], "top_p": 0}, "top_p"),
    ("completions", {"prompt": [1], "n": 17}, "n"),
    ("completions", {"prompt": [[1], [2, 999]]}, "prompt[1]"),
    ("completions", {"prompt": [[1], []]}, "prompt[1]"),
    ("completions", {"prompt": [1], "stop": ["a"] * 5}, "stop"),
    ("completions", {"prompt": [1], "seed": 1.5}, "seed"),
    ("completions", {"prompt": [999]}, "prompt"),
    ("completions", {"prompt": "\ud83d"}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}], "top_k": "2"}, "top_k"),
    ("chat/completions", {"messages": []}, "messages"),
    # Fields that would change the answer and are not implemented, or unknown: never ignored.
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("completions", {"prompt": [1], "guided_json": {"type": "object"}, "guided_regex": "a"},
     "guided_regex"),
    ("completions", {"prompt": [1], "temprature": 0}, "temprature"),
    ("completions", {"prompt": [1], "stream": True,
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options"),
    ("completions", {"prompt": [1], "stream": True, "stream_options": {"usage": True}},
     "stream_options"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4, "max_completion_tokens": 8}, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": "4", "max_completion_tokens": 4}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "store": True},
     "store"),
    ("completions", {"prompt": [1], "guided_json": {"type": "object"},
                     "guided_whitespace_pattern": "[ ]?"}, "guided_whitespace_pattern"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD,
                         ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD)])
def test_bad_requests_are_400s_naming_the_field(stack: Stack, fake: FakeInstance, path: str,
                                                body: dict[str, Any], param: str) -> None:
    status, answer = _post(f"{stack.routers['builtin']}/v1/{path}", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] is None
    assert fake.prefills == []


def test_length_limit_and_odd_bodies(stack: Stack, fake: FakeInstance) -> None:
    status, answer = _post(f"{stack.routers['short']}/v1/completions",
                           {"prompt": [1] * 30, "max_tokens": 11})
    assert status == 400 and "40" in answer["error"]["message"]
    assert answer["error"]["param"] == "max_tokens"
    base = stack.routers["builtin"]
    status, answer = _post(f"{base}/v1/completions", {"prompt": [1] * 30000})
    assert status == 413 and answer["error"]["type"] == "invalid_request_error"
    for raw in (b"{", b"[1, 2]", b"\xff\xfe", b'{"prompt": NaN}', b"null"):
        req = HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=10)
        req.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        resp = req.getresponse()
        data = json.loads(resp.read())
        req.close()
        assert resp.status == 400 and "message" in data["error"], (raw, data)
    status, answer = http("GET", f"{base}/v1/nothing")
    assert status == 404 and "/v1/nothing" in answer["error"]["message"]
    status, answer = _post(f"{base}/v1/completions", {"prompt": [1], "model": "other"})
    assert status == 404 and answer["error"]["param"] == "model"


def test_no_5xx_for_any_odd_field_value(stack: Stack, fake: FakeInstance) -> None:
    odd = [None, True, False, -1, 0, 2**70, 1e308, -0.0, "", "x", [], [None], {}, {"a": 1},
           ["\ud800"], [[1, 2], [3]], [1.0]]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
              "stop_token_ids", "stream", "ignore_eos", "n", "model", "stream_options",
              "logprobs", "echo", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "logit_bias", "min_tokens", "response_format"]
    for f in fields:
        for v in odd:
            body = {"prompt": [1], "max_tokens": 2, f: v}
            status, answer = _post(f"{stack.routers['builtin']}/v1/completions", body)
            assert status < 500, (f, v, answer)
            if status != 200:
                assert status in (400, 404) and answer["error"]["message"], (f, v, answer)
    for v in odd:
        status, answer = _post(f"{stack.routers['builtin']}/v1/chat/completions",
                               {"messages": v, "max_tokens": 2})
        assert status == 400, (v, answer)
        status, answer = _post(f"{stack.routers['builtin']}/v1/chat/completions",
                               {"messages": [{"role": "user", "content": v}], "max_tokens": 2})
        assert status in (200, 400), (v, answer)


# ---------------------------------------------------------------- cancellation
def test_client_gone_mid_stream_cancels_decode_and_releases(stack: Stack,
                                                            fake: FakeInstance) -> None:
    fake.script.tokens = list(b"a" * 500)
    fake.script.delay_s = 0.02
    u = urllib.parse.urlparse(stack.routers["builtin"])
    conn = HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions",
                 json.dumps({"prompt": [1], "max_tokens": 400, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    rid = fake.prefills[0]["request_id"]
    assert _wait(lambda: fake.cancelled == [rid] and fake.releases == [rid])
    assert len(fake.decodes) == 1


def test_client_gone_while_waiting_cancels_decode_and_releases(stack: Stack,
                                                               fake: FakeInstance) -> None:
    fake.script.tokens = list(b"a" * 500)
    fake.script.delay_s = 0.02
    with pytest.raises(OSError):
        _post(f"{stack.routers['builtin']}/v1/completions",
              {"prompt": [1], "max_tokens": 400}, timeout=0.5)
    assert _wait(lambda: len(fake.prefills) == 1)
    rid = fake.prefills[0]["request_id"]
    assert _wait(lambda: fake.cancelled == [rid] and fake.releases == [rid])


def test_client_gone_during_the_prefill_hangs_up_on_it(stack: Stack,
                                                       fake: FakeInstance) -> None:
    """The router has no grant yet, so nothing to release: it drops the prefill's connection,
    and the prefill cancels the request itself."""
    fake.script.prefill_delay_s = 2.0
    with pytest.raises(OSError):
        _post(f"{stack.routers['builtin']}/v1/completions",
              {"prompt": [1], "max_tokens": 4}, timeout=0.5)
    assert _wait(lambda: len(fake.prefills) == 1)
    assert _wait(lambda: fake.cancelled == [fake.prefills[0]["request_id"]])
    assert fake.decodes == [] and fake.releases == []


def test_client_gone_cancels_every_prompt_of_a_list(stack: Stack, fake: FakeInstance) -> None:
    """Each prompt of a list is its own request: a client gone mid-stream cancels each one's
    decode and releases each one's grant; nothing is left behind."""
    fake.script.tokens = list(b"a" * 500)
    fake.script.delay_s = 0.02
    u = urllib.parse.urlparse(stack.routers["builtin"])
    conn = HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions",
                 json.dumps({"prompt": [[1], [2], [3]], "max_tokens": 400, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "
    assert _wait(lambda: len(fake.decodes) == 3)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    rids = sorted(p["request_id"] for p in fake.prefills)
    assert len(set(rids)) == 3
    assert _wait(lambda: sorted(fake.cancelled) == rids and sorted(fake.releases) == rids)


def test_a_prefill_without_each_choices_first_token_is_a_502_and_released(
        stack: Stack, fake: FakeInstance) -> None:
    status, answer = _post(f"{stack.routers['builtin']}/v1/completions",
                           {"prompt": [[1], [2]], "max_tokens": 400, "n": 2, "seed": 1})
    # The fake answers one first_token where two were asked for: a 502, nothing left running.
    assert status == 502 and "first_tokens" in answer["error"]["message"], answer
    rids = sorted(p["request_id"] for p in fake.prefills)
    assert len(rids) == 2 and fake.decodes == []
    assert _wait(lambda: sorted(fake.releases) == rids)


def test_a_list_counts_each_prompt_against_the_routers_limit(stack: Stack,
                                                             fake: FakeInstance) -> None:
    url = f"{stack.routers['narrow']}/v1/completions"
    status, answer = _post(url, {"prompt": [[1], [2], [3], [4]], "max_tokens": 2})
    assert status == 429 and "4 prompts" in answer["error"]["message"], answer
    assert fake.prefills == []
    status, answer = _post(url, {"prompt": [[1], [2], [3]], "max_tokens": 2})
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2], answer
    assert answer["usage"]["prompt_tokens"] == 3 and len(fake.prefills) == 3


# ---------------------------------------------------------------- the real stack
def test_real_instances_serve_chat_and_completions(tmp_path: Path) -> None:
    from pdd_api.plan import SidePlan
    from pdd_api.routing import plan_routing
    from pdd_sidecar.engine.generate import generate
    from pdd_sidecar.serve.openai import tokenizer

    block = 16
    cluster = LocalCluster(tmp_path)
    try:
        side = SidePlan(tensor_parallel_size=1, decode_context_parallel_size=1)
        routing = cluster.plan_file(plan_routing(side, side, block).to_json())
        prefill = cluster.instance("prefill", 1, 1, routing, block)
        decode = cluster.instance("decode", 1, 1, routing, block, PDD_PREFILL_URLS=prefill.url)
        router = cluster.router([prefill], [decode], PDD_MODEL_NAME="tiny")
        for p in (prefill, decode, router):
            p.wait_ready()
        messages = [{"role": "user", "content": "Say something."}]
        prompt = tokenizer.encode("User: Say something.\n\nAssistant:")
        want = generate("builtin", prompt, 8, block_size=block)
        status, body = _post(f"{router.url}/v1/chat/completions",
                             {"messages": messages, "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want
        assert body["choices"][0]["message"]["content"] == tokenizer.decode(want)
        assert body["model"] == "tiny" and body["usage"]["prompt_tokens"] == len(prompt)
        status, events, _ = _sse(f"{router.url}/v1/completions",
                                 {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                  "stream": True})
        assert status == 200 and events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == want
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        status, body = _post(f"{router.url}/v1/completions",
                             {"prompt": [1, 2, 3], "max_tokens": 3, "top_p": 2})
        assert status == 400 and body["error"]["param"] == "top_p"
    finally:
        cluster.close()


def test_token_lines_are_json_and_the_router_reads_them_without_the_decoder() -> None:
    """The decode writes its token lines without the JSON encoder and the router reads them
    without the decoder: both must stay exactly what json.dumps writes."""
    from pdd_sidecar.serve.instance.decode_api import _token_lines
    from pdd_sidecar.serve.router.upstreams import _token_line

    ids = [0, 7, 129279, 10**9]
    lines = _token_lines(ids)
    assert lines == b"".join(json.dumps({"token": t}).encode() + b"\n" for t in ids)
    assert [_token_line(line) for line in lines.split(b"\n")[:-1]] == ids
    for other in (b'{"token": 5, "timing": {}}', b'{"token": -1}', b'{"token": 1.5}',
                  b'{"token": "5"}', b'{"done": true}', b'{"token": }', b""):
        assert _token_line(other) is None, other


def test_choice_token_lines_are_json_and_read_without_the_decoder() -> None:
    from pdd_sidecar.serve.instance.decode_api import _choice_lines
    from pdd_sidecar.serve.router.upstreams import _choice_token_line

    pairs = [(0, 7), (15, 129279), (3, 0)]
    no_logprobs: Any = types.SimpleNamespace(logprobs=None)  # a sequence that asked for none
    lines = _choice_lines(no_logprobs, pairs, {})
    assert lines == b"".join(json.dumps({"choice": j, "token": t}).encode() + b"\n"
                             for j, t in pairs)
    assert [_choice_token_line(line) for line in lines.split(b"\n")[:-1]] == pairs
    for other in (b'{"choice": 1, "token": 5, "timing": {}}', b'{"choice": -1, "token": 1}',
                  b'{"choice": 1, "token": "5"}', b'{"token": 5}', b'{"choice": 1}', b""):
        assert _choice_token_line(other) is None, other
