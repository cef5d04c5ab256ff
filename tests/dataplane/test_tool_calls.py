"""Tool calling through the router, with the official openai SDK as the client.

The router sits in front of a scripted instance (test_openai_api.py's fake) that answers with
the tokens of a DeepSeek-V3 tool-call block: a random tiny model never writes one by itself,
and forcing one (tool_choice required / named) waits for constrained decoding. What is checked
is the serving path: the prompt the instance gets (against transformers' apply_chat_template
on the same template and tools), the parsed tool_calls (JSON that validates against the tool's
parameters), and the streamed deltas adding up to the whole answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_openai_api import FakeInstance, Loop
from tool_cases import BOS, EOS, TIME, WEATHER, block, deepseek_dir

from pdd_sidecar.env import RouterSettings
from pdd_sidecar.serve.router.router import build_app

pytestmark = pytest.mark.dataplane

TOOLS = [WEATHER, TIME]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"temp_c": 3}'},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_dir(tmp_path_factory.mktemp("ds-tools"))


@pytest.fixture(scope="module")
def served(ckpt: Path) -> Iterator[tuple[FakeInstance, str]]:
    loop = Loop()
    try:
        fake = FakeInstance()
        fake.url = loop.serve(fake.app())
        env = {"PDD_PREFILL_URLS": fake.url, "PDD_DECODE_URLS": fake.url,
               "PDD_MODEL_NAME": "served", "PDD_MODEL_SOURCE": str(ckpt),
               "PDD_ROUTER_HEALTH_INTERVAL_S": "0.2",
               # The fake scripts the prefill -> decode protocol: every request through it.
               "PDD_ROUTER_LOCAL_PREFILL_TOKENS": "0"}
        yield fake, loop.serve(build_app(RouterSettings.from_env(env)))
    finally:
        loop.close()


@pytest.fixture
def client(served: tuple[FakeInstance, str]) -> Any:
    from openai import OpenAI

    served[0].reset()
    return OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


def _script(fake: FakeInstance, ckpt: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    ids = list(AutoTokenizer.from_pretrained(str(ckpt)).encode(text, add_special_tokens=False))
    fake.script.first, fake.script.tokens = ids[0], ids[1:]
    return ids


def test_the_prompt_with_tools_is_transformers_apply_chat_template(
        served: tuple[FakeInstance, str], ckpt: Path, client: Any) -> None:
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(ckpt))
    fake = served[0]
    _script(fake, ckpt, "Sunny." + EOS)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Weather in Paris?"}]
    client.chat.completions.create(model="served", messages=messages, tools=TOOLS,
                                   max_tokens=8)
    want = oracle.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert fake.prefills[-1]["prompt_ids"] == list(want)
    assert "### get_time" in oracle.decode(want)
    # Tool turns. transformers 5 drops `content: None` before rendering, and DeepSeek's
    # template cannot render a tool-call turn without it; its own template engine, given the
    # turn as OpenAI clients send it, is the oracle (docs/openai-api.md, Tool calling).
    from transformers.utils.chat_template_utils import _compile_jinja_template

    client.chat.completions.create(model="served", messages=HISTORY, tools=TOOLS, max_tokens=8)
    text = _compile_jinja_template(oracle.chat_template).render(
        messages=HISTORY, tools=TOOLS, add_generation_prompt=True, bos_token=BOS,
        eos_token=EOS)
    assert fake.prefills[-1]["prompt_ids"] == oracle.encode(text, add_special_tokens=False)
    assert '{"city": "Oslo"}' in text and '{"temp_c": 3}' in text
    # The same turns with content "" go through apply_chat_template itself.
    flat = [dict(m, content="") if m.get("tool_calls") else m for m in HISTORY]
    client.chat.completions.create(model="served", messages=flat, tools=TOOLS, max_tokens=8)
    want = oracle.apply_chat_template(flat, tools=TOOLS, add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    assert fake.prefills[-1]["prompt_ids"] == list(want)


def test_tool_calls_through_the_sdk_whole_and_streamed(served: tuple[FakeInstance, str],
                                                       ckpt: Path, client: Any) -> None:
    import jsonschema

    fake = served[0]
    calls = [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
             ("get_time", '{"zone": "Europe/Paris"}')]
    _script(fake, ckpt, "Checking." + block(*calls))
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    whole = client.chat.completions.create(model="served", messages=messages, tools=TOOLS,
                                           tool_choice="auto", max_tokens=200)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    got = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in got:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])

    stream = client.chat.completions.create(model="served", messages=messages, tools=TOOLS,
                                            max_tokens=200, stream=True)
    content, parts, finish, chunks = "", {}, None, 0
    for chunk in stream:
        chunks += 1
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id:
                assert d.index not in parts and d.type == "function"
                parts[d.index] = [d.id, d.function.name, ""]
            parts[d.index][2] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Checking."
    assert [(name, args) for _, name, args in (parts[i] for i in sorted(parts))] == calls
    assert chunks > 10  # the arguments came in pieces

    # The answer goes back as history (content None, as the SDK returns it) with the results.
    history = [*messages, choice.message.model_dump(exclude_none=False),
               {"role": "tool", "tool_call_id": got[0].id, "content": '{"temp_c": 21}'},
               {"role": "tool", "tool_call_id": got[1].id, "content": '"12:00"'}]
    _script(fake, ckpt, "21 C at noon." + EOS)
    after = client.chat.completions.create(model="served", messages=history, tools=TOOLS,
                                           max_tokens=20)
    assert after.choices[0].message.content == "21 C at noon."
    assert after.choices[0].finish_reason == "stop" and not after.choices[0].message.tool_calls


def test_tool_choice_none_and_refusals_through_the_sdk(served: tuple[FakeInstance, str],
                                                       ckpt: Path, client: Any) -> None:
    import openai

    fake = served[0]
    ids = _script(fake, ckpt, block(("get_time", "{}")))
    answer = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
        tool_choice="none", max_tokens=len(ids))
    assert not answer.choices[0].message.tool_calls  # not parsed: the text is the answer
    assert answer.choices[0].finish_reason == "stop"
    for extra, param in [({"tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "tool_choice"),
                         ({"tool_choice": {"type": "function",
                                           "function": {"name": "get_date"}}}, "tool_choice"),
                         ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                          "tools")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="served", messages=[{"role": "user", "content": "Time?"}],
                **{"tools": TOOLS, **extra})
        assert err.value.status_code == 400 and err.value.body["param"] == param


# ---------------------------------------------------------------- forced calls on a real stack
@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A random tiny DeepSeek-V3 with the tool-call tokens in its tokenizer, served by a
    prefill, a decode and the router on the CPU."""
    from model_fixtures import V3_GROUPED, write_v3_checkpoint
    from runtime_fixtures import LocalCluster, plan_json

    ckpt = tmp_path_factory.mktemp("ds-tools-real")
    write_v3_checkpoint(ckpt, V3_GROUPED, seed=7)
    deepseek_dir(ckpt, model_vocab=json.loads((ckpt / "config.json").read_text())["vocab_size"])
    cluster = LocalCluster(tmp_path_factory.mktemp("ds-tools-stack"))
    try:
        routing = cluster.plan_file(plan_json((1, 1), (1, 1), 16))
        src = {"PDD_MODEL_SOURCE": str(ckpt)}
        prefill = cluster.instance("prefill", 1, 1, routing, 16, **src)
        decode = cluster.instance("decode", 1, 1, routing, 16, PDD_PREFILL_URLS=prefill.url,
                                  **src)
        router = cluster.router([prefill], [decode], PDD_MODEL_NAME="tiny", **src)
        for p in (prefill, decode, router):
            p.wait_ready(240)
        yield router.url, ckpt
    finally:
        cluster.close()


# Bounded arguments: a random model given a free string writes until max_tokens.
BOUNDED = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 6},
                       "unit": {"enum": ["celsius", "kelvin"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["CET", "UTC"]}}}}},
]


@pytest.mark.parametrize("choice", ["required", "named", "single"])
def test_forced_tool_calls_from_a_random_model(real: tuple[str, Path], choice: str) -> None:
    """The model never calls by itself; under tool_choice required / named the grammar makes
    every answer calls whose arguments validate against their tool's parameters."""
    import jsonschema
    from openai import OpenAI

    url, _ = real
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    extra: dict[str, Any] = {"tool_choice": "required"}
    if choice == "named":
        extra = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if choice == "single":
        extra["parallel_tool_calls"] = False
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in (1, 2):
        body = {"model": "tiny", "messages": messages, "tools": BOUNDED, "max_tokens": 80,
                "temperature": 0.8, "seed": seed, **extra}
        whole = client.chat.completions.create(**body).choices[0]
        calls = whole.message.tool_calls
        assert calls and not whole.message.content, whole
        complete = calls
        if choice == "required" and whole.finish_reason == "length":
            complete = calls[:-1]  # the grammar lets calls follow calls; the last was cut
            assert len(calls) >= 2, whole
        else:
            assert whole.finish_reason == "tool_calls", whole
        if choice != "required":
            assert len(calls) == 1
        if choice == "named":
            assert calls[0].function.name == "get_weather"
        for c in complete:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
        parts: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(**body, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                if d.id:
                    parts[d.index] = [d.function.name, ""]
                parts[d.index][1] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason  # the same seed: the same answer
        assert [tuple(parts[i]) for i in sorted(parts)] == [
            (c.function.name, c.function.arguments) for c in calls]


def test_strict_tools_under_auto_hold_a_call_to_its_schema(real: tuple[str, Path]) -> None:
    """tool_choice auto with strict tools: the model decides. This random model never calls by
    itself, so a logit_bias on the block's opening token makes it start one; from there the
    grammar must carry it through whole calls whose arguments validate (unconstrained, the
    same model writes no such block)."""
    import jsonschema
    from openai import OpenAI

    from pdd_sidecar.serve.openai.text import load_model_text
    from pdd_sidecar.serve.openai.tool_parser import Markers

    url, ckpt = real
    markers = Markers.of(load_model_text(str(ckpt)).codec)
    assert markers is not None
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    strict = [{"type": "function", "function": {**t["function"], "strict": True}}
              for t in BOUNDED]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in (1, 2):
        body = {"model": "tiny", "messages": messages, "tools": strict, "max_tokens": 80,
                "temperature": 0.8, "seed": seed, "parallel_tool_calls": False,
                "logit_bias": {str(markers.calls_begin): 100}}
        whole = client.chat.completions.create(**body).choices[0]
        calls = whole.message.tool_calls
        assert calls and len(calls) == 1 and whole.finish_reason == "tool_calls", whole
        jsonschema.validate(json.loads(calls[0].function.arguments),
                            schemas[calls[0].function.name])
    # Without the bias the model answers in text, as auto lets it.
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=strict,
                                           max_tokens=8, temperature=0.8, seed=1).choices[0]
    assert not plain.message.tool_calls and plain.finish_reason == "length", plain
