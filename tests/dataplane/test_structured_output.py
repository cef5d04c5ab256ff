"""Structured output end to end: a random tiny DeepSeek-V3 checkpoint with its own BPE tokenizer
(written here), served by a prefill, a decode and the router on the CPU; every constrained
answer parses and validates, through plain HTTP and the official `openai` SDK, streamed and
not, greedy and sampled; and the batched sampler's mask against llguidance's own reference.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from runtime_fixtures import LocalCluster, http, plan_json

from pdd_sidecar.engine.grammar_mask import Grammars, advance, fill_bitmask
from pdd_sidecar.engine.sampling import Allowed, SamplingParams, apply_allowed, sample
from pdd_sidecar.grammar import Spec

pytestmark = pytest.mark.dataplane

BOS, EOS = "<s>", "</s>"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
CORPUS = ['{"name": "Ada", "age": 36, "ok": true}', '{"city": "Paris", "n": [1, 2, 3]}',
          "user: give me JSON\nassistant: yes no maybe 2026-12-04 abc-123"] * 50
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = "[a-z]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe not"]


def write_checkpoint(path: Path) -> Path:
    """Random V3 weights (vocabulary 256) and a byte-level BPE trained on a few JSON lines:
    ~140 tokens, the rest of the vocabulary unused, as a real checkpoint pads it."""
    from model_fixtures import V3_GROUPED, write_v3_checkpoint
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    write_v3_checkpoint(path, V3_GROUPED, seed=5)
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = [level.pre_tokenize_str(chr(c))[0][0] for c in range(32, 127)] + ["Ċ"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = level
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=256, special_tokens=[BOS, EOS], initial_alphabet=alphabet,
        limit_alphabet=len(alphabet)))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE}))
    for name in ("config.json", "generation_config.json"):
        p = path / name
        if p.is_file():
            cfg = json.loads(p.read_text())
            cfg.update(eos_token_id=tok.token_to_id(EOS), bos_token_id=tok.token_to_id(BOS))
            p.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    return write_checkpoint(tmp_path_factory.mktemp("structured-ckpt"))


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("structured-stack"))
    try:
        routing = cluster.plan_file(plan_json((1, 1), (1, 1), 16))
        model = {"PDD_MODEL_SOURCE": str(model_dir)}
        prefill = cluster.instance("prefill", 1, 1, routing, 16, **model)
        decode = cluster.instance("decode", 1, 1, routing, 16, PDD_PREFILL_URLS=prefill.url,
                                  **model)
        r = cluster.router([prefill], [decode], PDD_MODEL_NAME="tiny", **model)
        for p in (prefill, decode, r):
            p.wait_ready(240)
        yield {"router": r.url, "prefill": prefill.url, "decode": decode.url}
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def router(stack: dict[str, str]) -> str:
    return stack["router"]


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http("POST", url, body, timeout=120)


def _stream(url: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """The streamed text and finish reason of one choice."""
    import urllib.request

    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    text, finish = "", None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def _ask(router: str, kind: str, extra: dict[str, Any], stream: bool, temperature: float,
         seed: int, max_tokens: int = 120) -> tuple[str, str | None]:
    if kind == "chat":
        url = f"{router}/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "give me JSON"}]}
    else:
        url = f"{router}/v1/completions"
        body = {"prompt": "user: give me JSON\nassistant:"}
    body.update(extra, max_tokens=max_tokens, temperature=temperature, seed=seed)
    if stream:
        return _stream(url, body)
    status, answer = _post(url, body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return choice.get("text", choice.get("message", {}).get("content")), choice["finish_reason"]


CASES = [(kind, stream, temperature) for kind in ("completion", "chat")
         for stream in (False, True) for temperature in (0.0, 1.0)]


@pytest.mark.parametrize(("kind", "stream", "temperature"), CASES,
                         ids=[f"{k}-{'stream' if s else 'whole'}-t{t:g}" for k, s, t in CASES])
def test_every_form_is_obeyed(router: str, kind: str, stream: bool, temperature: float) -> None:
    for seed in range(3):
        schema_form = ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA, "strict": True}}} if seed % 2 == 0
                       else {"guided_json": SCHEMA})
        text, finish = _ask(router, kind, schema_form, stream, temperature, seed)
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), SCHEMA)

        text, finish = _ask(router, kind, {"structured_outputs": {"regex": REGEX}}, stream,
                            temperature, seed)
        assert finish == "stop" and re.fullmatch(REGEX, text), (text, finish)

        text, finish = _ask(router, kind, {"guided_choice": CHOICES}, stream, temperature, seed)
        assert finish == "stop" and text in CHOICES, (text, finish)

        text, finish = _ask(router, kind, {"guided_grammar": 'start: "(" NUM ("," NUM)* ")"\n'
                                           'NUM: /[0-9]{1,2}/'}, stream, temperature, seed, 40)
        if finish == "stop":
            assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text), text
        else:  # the grammar allows any length; a random model may run to max_tokens
            assert finish == "length" and re.fullmatch(r"\([0-9,]*", text), text


def test_json_object_parses(router: str) -> None:
    stopped = 0
    for seed in range(6):
        for stream in (False, True):
            text, finish = _ask(router, "chat", {"response_format": {"type": "json_object"}},
                                stream, 1.0 if seed else 0.0, seed, max_tokens=200)
            if finish == "stop":
                stopped += 1
                assert isinstance(json.loads(text), dict), text
            else:  # an object of any size: a random model may not close it within max_tokens
                assert finish == "length" and text.startswith("{"), text
    assert stopped >= 3


def test_too_few_tokens_for_the_grammar_is_length(router: str) -> None:
    text, finish = _ask(router, "completion", {"guided_json": SCHEMA}, False, 0.0, 0,
                        max_tokens=3)
    assert finish == "length" and text.startswith("{")


def test_an_uncompilable_schema_is_a_400_naming_response_format(router: str) -> None:
    for body, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
         "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ]:
        status, answer = _post(f"{router}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **body})
        assert status == 400 and answer["error"]["param"] == param, answer
        assert answer["error"]["message"].startswith(param)
    status, answer = _post(f"{router}/v1/completions", {"prompt": "ok", "max_tokens": 3})
    assert status == 200, answer  # nothing left behind: the next request is served


def test_the_instances_refuse_what_they_cannot_compile(stack: dict[str, str]) -> None:
    """An instance API client (a proxy, vLLM's protocol) gets the same check the router makes:
    a 400 naming sampling.structured, and nothing held."""
    for raw in ({"kind": "regex", "value": "[a-"}, {"kind": "json_schema", "value": {"type": 7}},
                {"kind": "yaml", "value": "a"}):
        status, answer = _post(f"{stack['prefill']}/v1/prefill", {
            "prompt_ids": [5, 6, 7], "max_tokens": 4,
            "sampling": {"temperature": 0, "structured": raw}})
        assert status == 400 and "sampling.structured" in answer["error"]["message"], answer
    status, answer = _post(f"{stack['prefill']}/v1/prefill", {
        "prompt_ids": [5, 6, 7], "max_tokens": 1,
        "sampling": {"temperature": 0, "structured": {"kind": "choice", "value": ["ab"]}}})
    assert status == 200 and answer["kv_transfer_params"] is None, answer


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(router: str) -> None:
    plain = {"prompt": "user: abc\nassistant:", "max_tokens": 24, "temperature": 1.0,
             "seed": 42, "ignore_eos": True}
    status, alone = _post(f"{router}/v1/completions", plain)
    assert status == 200, alone
    results: dict[int, Any] = {}

    def send(i: int) -> None:
        body = plain if i == 0 else {"prompt": "user: give me JSON\nassistant:",
                                     "max_tokens": 60, "guided_json": SCHEMA, "seed": i,
                                     "temperature": 1.0}
        results[i] = _post(f"{router}/v1/completions", body)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 for s, _ in results.values()), results
    assert results[0][1]["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    for i in (1, 2, 3):
        jsonschema.validate(json.loads(results[i][1]["choices"][0]["text"]), SCHEMA)


def test_the_openai_sdk(router: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{router}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "give me JSON"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                              response_format=fmt, max_tokens=120,
                                              temperature=temperature, seed=3)
        content = chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "stop" and content is not None
        jsonschema.validate(json.loads(content), SCHEMA)
        chunks = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                                response_format=fmt, max_tokens=120,
                                                temperature=temperature, seed=4, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), SCHEMA)
        done = client.completions.create(model="tiny", prompt="user: code\nassistant:",
                                         max_tokens=20, temperature=temperature, seed=5,
                                         extra_body={"guided_regex": REGEX})
        assert re.fullmatch(REGEX, done.choices[0].text), done.choices[0].text
        parts = client.completions.create(model="tiny", prompt="user: pick\nassistant:",
                                          max_tokens=20, temperature=temperature, seed=6,
                                          stream=True, extra_body={"guided_choice": CHOICES})
        assert "".join(p.choices[0].text for p in parts if p.choices) in CHOICES
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages,  # type: ignore
                                       max_tokens=5, response_format={
                                           "type": "json_schema", "json_schema": {
                                               "name": "x", "schema": {"type": 7}}})
    assert err.value.body["param"] == "response_format"  # type: ignore[index]


# ---------------------------------------------------------------- the batched sampler's mask
def test_the_mask_is_llguidances_reference_on_constrained_rows_only(model_dir: Path) -> None:
    from llguidance.numpy import apply_token_bitmask_inplace

    grammars = Grammars(str(model_dir), 256, frozenset({1}))
    specs = [Spec("json_schema", json.dumps(SCHEMA)), Spec("regex", REGEX),
             Spec("choice", json.dumps(CHOICES))]
    rows = [grammars.start(s) for s in specs]
    logits = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    constrained = [0, 2, 4]
    mask = fill_bitmask(rows, pin=False)
    got = apply_allowed(logits, Allowed(constrained, mask))
    for r, b in enumerate(constrained):
        want = logits[b:b + 1].numpy().copy()
        apply_token_bitmask_inplace(want, mask[r:r + 1].numpy())
        assert torch.equal(got[b], torch.from_numpy(want[0]))
        assert torch.isinf(got[b]).any() and torch.isfinite(got[b]).any()
    for b in (1, 3):
        assert torch.equal(got[b], logits[b])


def test_greedy_and_sampled_rows_follow_their_grammar_to_the_end(model_dir: Path) -> None:
    """The sampler alone, 6 rows (3 constrained, greedy and sampled) on random logits: each
    constrained row's text matches its grammar when the matcher says it is complete."""
    grammars = Grammars(str(model_dir), 256, frozenset({1}))
    codec = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    text_of = {i: t for t, i in codec.items()}
    from tokenizers import decoders

    dec = decoders.ByteLevel()
    specs = {0: Spec("json_schema", json.dumps(SCHEMA)), 2: Spec("regex", REGEX),
             5: Spec("choice", json.dumps(CHOICES))}
    state = {b: grammars.start(s) for b, s in specs.items()}
    params = [SamplingParams(temperature=0.0 if b % 2 else 1.0, seed=b) for b in range(6)]
    out: dict[int, list[int]] = {b: [] for b in specs}
    done: set[int] = set()
    g = torch.Generator().manual_seed(1)
    for step in range(150):
        live = [b for b in specs if b not in done]
        if not live:
            break
        logits = torch.randn(6, 256, generator=g) * 3
        mask = fill_bitmask([state[b] for b in live], pin=False)
        rows = list(range(6))
        toks = sample(logits, params, [step] * 6, None, Allowed(live, mask))
        for b in live:
            out[b].append(toks[b])
            if advance(state[b].matcher, toks[b]):
                done.add(b)
        for b in rows:
            if b not in specs:  # unconstrained: the same draw as without any mask
                assert toks[b] == sample(logits[b:b + 1], [params[b]], [step])[0]
    assert done == set(specs)
    texts = {b: dec.decode([text_of[t] for t in out[b] if t in text_of]) for b in specs}
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(REGEX, texts[2]) and texts[5] in CHOICES, texts
