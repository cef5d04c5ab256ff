"""Tool calling without a server: the request's tools checked, the template given them, the
DeepSeek tool-call block parsed from token ids (whole and streamed, which must agree).

The comparison of the rendered prompt with transformers' apply_chat_template and the answers
through the openai SDK live in tests/dataplane/test_tool_calls.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tool_cases import (
    BOS,
    EOS,
    TIME,
    TOOL_TEMPLATE,
    V3_TEMPLATE,
    WEATHER,
    block,
    deepseek_dir,
)

from pdd_sidecar.serve.openai.completion_output import Output
from pdd_sidecar.serve.openai.openai_request import ApiError, parse_request
from pdd_sidecar.serve.openai.text import ModelText, load_model_text, render_chat
from pdd_sidecar.serve.openai.tool_grammar import tool_call_grammar
from pdd_sidecar.serve.openai.tool_parser import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    Markers,
    ToolCallParser,
    template_call_format,
)

USER = [{"role": "user", "content": "Weather in Paris?"}]

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelText:
    return load_model_text(str(deepseek_dir(tmp_path_factory.mktemp("ds"))))


def _chat(model: ModelText, **extra: Any) -> Any:
    return parse_request("chat", {"messages": USER, **extra}, model, "served")


def _refused(model: ModelText, **extra: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        _chat(model, **extra)
    assert err.value.status == 400
    return err.value


# ---------------------------------------------------------------- the request
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
DEEP: dict[str, Any] = {"type": "object"}
for _ in range(3000):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
BAD_TOOLS = [
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": ["get_weather"]}, "tools", "tools[0] must be an object"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name"}}]}, "tools",
     "tools[1].function.name must match"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools", "tools[0].function.parameters must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]}, "tools", "tools[0].function.parameters is not a valid JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools",
     "tools[0].function.description"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given more than once"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]}, "tools",
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "tool_choice must be one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among tools"),
    ({"tools": [WEATHER], "tool_choice": {"function": "get_weather"}}, "tool_choice",
     "tool_choice must be"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}],
      "tool_choice": "required"}, "tools", "cannot be enforced"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "parallel_tool_calls must be true or false"),
    ({"tools": [STRICT_WEATHER], "response_format": {"type": "json_object"}}, "tools",
     "cannot be enforced beside structured output"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}]},
     "tools", "cannot be enforced for strict"),
]


@pytest.mark.parametrize(("extra", "param", "says"), BAD_TOOLS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_TOOLS)])
def test_bad_tool_fields_are_400s_naming_them(model: ModelText, extra: dict[str, Any],
                                              param: str, says: str) -> None:
    err = _refused(model, **extra)
    assert err.param == param
    assert err.message.startswith(param) and says in err.message, err.message


BAD_TURNS = [
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}],
     "messages[1].tool_calls[0].function.arguments must be a string"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {
        "name": "f", "arguments": "{}"}}]}], "messages[1].tool_calls[0] must be"),
    ([{"role": "assistant", "content": None, "tool_calls": {"id": "x"}}],
     "messages[1].tool_calls must be a list"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages"),
    ([{"role": "tool", "content": "21"}], "messages[1].tool_call_id must be a string"),
    ([{"role": "tool", "tool_call_id": "call_1"}], "messages[1].content"),
]


@pytest.mark.parametrize(("turns", "says"), BAD_TURNS, ids=[str(i) for i in range(len(BAD_TURNS))])
def test_bad_tool_turns_are_400s_naming_messages(model: ModelText, turns: list[Any],
                                                 says: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_request("chat", {"messages": USER + turns}, model, "served")
    assert (err.value.status, err.value.param) == (400, "messages")
    assert says in err.value.message, err.value.message


def test_tools_reach_the_template_and_none_keeps_them_out(model: ModelText) -> None:
    assert model.codec is not None
    req = _chat(model, tools=[WEATHER, TIME])
    assert req.tools is not None and req.tools.parse and req.tools.parallel
    text = model.codec.decode_raw(req.prompt_ids)
    assert "### get_weather\nDescription: Current weather of a city" in text
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert "### get_time\nDescription: \n" in text
    plain = _chat(model)
    assert plain.tools is None and "## Tools" not in model.codec.decode_raw(plain.prompt_ids)
    none = _chat(model, tools=[WEATHER], tool_choice="none", parallel_tool_calls=False)
    assert none.prompt_ids == plain.prompt_ids
    assert none.tools is not None and not none.tools.parse
    assert Output(none, model).tools is None  # nothing is parsed as a call
    assert _chat(model, tools=[WEATHER], parallel_tool_calls=False).tools.parallel is False


def test_a_template_without_tools_refuses_them_but_renders_tool_turns(tmp_path: Path) -> None:
    v3 = load_model_text(str(deepseek_dir(tmp_path, V3_TEMPLATE)))
    err = _refused(v3, tools=[WEATHER])
    assert err.param == "tools" and "does not render tool definitions" in err.message
    assert _chat(v3, tools=[WEATHER], tool_choice="none").tools is not None
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    req = parse_request("chat", {"messages": history}, v3, "served")
    assert v3.codec is not None
    assert v3.codec.decode_raw(req.prompt_ids) == (
        f"{BOS}<｜User｜>Weather in Paris?<｜Assistant｜>{CALLS_BEGIN}{CALL_BEGIN}function{SEP}"
        f'get_weather\n```json\n{{"city": "Paris"}}\n```{CALL_END}<｜tool▁outputs▁begin｜>'
        '<｜tool▁output▁begin｜>{"temp_c": 21}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>')


def test_a_template_that_writes_v3_1_calls_refuses_tools(tmp_path: Path) -> None:
    """DeepSeek-V3.1 writes NAME<｜tool▁sep｜>ARGUMENTS: the parser would find no call and the
    answer would carry the block as text, so such a template is a 400, never that 200."""
    v31 = TOOL_TEMPLATE.replace(
        "tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + "
        "'\\n' + tool['function']['arguments'] + '\\n' + '```' + ",
        "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + ")
    assert v31.count("tool['function']['name'] + '<｜tool▁sep｜>'") == 2
    assert template_call_format(v31) == "v3.1"
    assert template_call_format(TOOL_TEMPLATE) == template_call_format(V3_TEMPLATE) == "v3"
    assert template_call_format("{{ messages[0]['content'] }}") is None
    err = _refused(load_model_text(str(deepseek_dir(tmp_path, v31))), tools=[WEATHER])
    assert err.param == "tools" and "DeepSeek-V3.1's format" in err.message, err.message


def test_models_without_the_format_refuse_tools() -> None:
    err = _refused(load_model_text("builtin"), tools=[WEATHER])
    assert err.param == "tools"
    assert "tools" not in render_chat("{{ messages[0]['content'] }}", USER, {}, tools=[WEATHER])


def test_a_tokenizer_without_the_tool_tokens_refuses_tools(tmp_path: Path) -> None:
    d = deepseek_dir(tmp_path)
    raw = json.loads((d / "tokenizer.json").read_text())
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != SEP]
    (d / "tokenizer.json").write_text(json.dumps(raw))
    err = _refused(load_model_text(str(d)), tools=[WEATHER])
    assert err.param == "tools" and "tool-call tokens" in err.message


# ---------------------------------------------------------------- the answer
def _answer(model: ModelText, text: str, max_tokens: int = 400, stop: list[str] | None = None,
            **extra: Any) -> tuple[Output, list[tuple[str, list[dict[str, Any]]]], list[int]]:
    """The answer ``text`` would get, fed token by token as the router feeds it; with each
    token's (content delta, tool-call deltas)."""
    assert model.codec is not None
    body: dict[str, Any] = {"tools": [WEATHER, TIME], "max_tokens": max_tokens, **extra}
    if stop:
        body["stop"] = stop
    req = _chat(model, **body)
    out = Output(req, model)
    ids = model.codec.encode(text, add_special_tokens=False)
    steps = []
    for n, token in enumerate(ids, 1):
        delta = out.add(token)
        steps.append((delta, out.pop_tool_deltas(n)))
        if out.finish is not None:
            break
    else:
        steps.append((out.end("stop"), out.pop_tool_deltas(len(ids))))
    return out, steps, ids


def _reassemble(steps: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str, list[Any]]:
    content, calls = "", []
    for text, deltas in steps:
        content += text
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append({"id": d["id"], "type": "function",
                              "function": {"name": d["function"]["name"], "arguments": ""}})
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content, calls


def test_one_call_is_parsed_and_its_stream_adds_up_to_it(model: ModelText) -> None:
    args = '{"city": "Paris", "unit": "celsius"}'
    out, steps, ids = _answer(model, "Let me check." + block(("get_weather", args)))
    assert out.finish == "tool_calls"
    assert out.text == "Let me check."
    [call] = out.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": args}
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert _reassemble(steps) == (out.text, out.tool_calls)
    fragments = sum(len(d) for _, d in steps)
    assert fragments > 3  # the arguments streamed in pieces, not at the end
    assert out.token_ids == ids


def test_arguments_in_any_script_stream_whole(model: ModelText) -> None:
    args = json.dumps({"city": "héllo 日本語 🙂 " * 40, "unit": "celsius"}, ensure_ascii=False)
    out, steps, _ = _answer(model, block(("get_weather", args)), max_tokens=3500)
    assert out.tool_calls[0]["function"]["arguments"] == args
    assert _reassemble(steps) == ("", out.tool_calls)
    assert not any("\ufffd" in d["function"]["arguments"] for _, ds in steps for d in ds)


def test_several_calls_each_with_its_index(model: ModelText) -> None:
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}'),
             ("get_weather", '{\n  "city": "Oslo"\n}')]
    out, steps, _ = _answer(model, block(*calls))
    assert out.finish == "tool_calls" and out.text == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in out.tool_calls] == calls
    assert len({c["id"] for c in out.tool_calls}) == 3
    assert _reassemble(steps) == ("", out.tool_calls)


def test_parallel_tool_calls_false_ends_the_answer_at_the_first_call(model: ModelText) -> None:
    out, steps, ids = _answer(model, block(("get_weather", '{"city": "Paris"}'),
                                           ("get_time", "{}")), parallel_tool_calls=False)
    assert out.finish == "tool_calls" and out.stopped_by_string  # the decode is closed here
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"]
    assert len(out.token_ids) < len(ids)


def test_a_cut_call_finishes_on_length_with_its_arguments_so_far(model: ModelText) -> None:
    text = block(("get_weather", '{"city": "Paris", "unit": "kelvin"}'))
    full, _, ids = _answer(model, text)
    n = len(ids) - 6
    out, steps, _ = _answer(model, text, max_tokens=n)
    assert out.finish == "length" and len(out.token_ids) == n
    [call] = out.tool_calls
    assert full.tool_calls[0]["function"]["arguments"].startswith(call["function"]["arguments"])
    assert 0 < len(call["function"]["arguments"]) < len(full.tool_calls[0]["function"]
                                                         ["arguments"])
    assert _reassemble(steps) == ("", out.tool_calls)


def test_a_header_cut_by_the_length_limit_is_dropped(model: ModelText) -> None:
    first = block(("get_time", '{"zone": "CET"}'), end=False)
    text = first + f"\n{CALL_BEGIN}function{SEP}get_wea"
    full, _, ids = _answer(model, text + "ther\n```json\n{}\n```" + CALL_END + CALLS_END + EOS)
    assert len(full.tool_calls) == 2
    n = len(model.codec.encode(text, add_special_tokens=False)) if model.codec else 0
    for cut in (n, n - 2, n - 5):  # in the name, at the separator, in the type
        out, steps, _ = _answer(model, text, max_tokens=cut)
        assert (out.finish, out.text) == ("length", "")
        assert [c["function"]["name"] for c in out.tool_calls] == ["get_time"]
        assert _reassemble(steps) == ("", out.tool_calls)


@pytest.mark.parametrize("broken", [
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather {{\"city\": \"Paris\"}}{CALL_END}"
    f"{CALLS_END}",  # no fenced header
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```python\nx\n```{CALL_END}",
    f"{CALLS_BEGIN}{CALL_BEGIN}tool{SEP}get_weather\n```json\n{{}}\n```{CALL_END}{CALLS_END}",
    f"{CALLS_BEGIN}Sure, the weather{CALLS_END}",  # text where a call should begin
    f"{CALLS_BEGIN}{CALL_BEGIN}function{CALL_END}",
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather",  # ends inside the header
])
def test_a_broken_block_is_content_with_its_markers(model: ModelText, broken: str) -> None:
    out, steps, _ = _answer(model, "Hmm. " + broken + EOS)
    assert (out.text, out.tool_calls, out.finish) == ("Hmm. " + broken, [], "stop")
    assert _reassemble(steps) == (out.text, [])


def test_a_marker_inside_the_arguments_ends_the_call_there(model: ModelText) -> None:
    """The call was announced when its header completed (streamed clients have it): it stays,
    with its arguments as far as they were sure, and the rest is content."""
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{\"a\": 1{SEP}2}}"
    out, steps, _ = _answer(model, text + EOS)
    assert [c["function"] for c in out.tool_calls] == [{"name": "get_weather",
                                                        "arguments": '{"a": 1'}]
    assert out.text == SEP + "2}" and out.finish == "tool_calls"
    assert _reassemble(steps) == (out.text, out.tool_calls)


def test_a_break_after_a_good_call_keeps_the_call(model: ModelText) -> None:
    good = f"{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}\n```{CALL_END}"
    bad = f"\n{CALL_BEGIN}function{SEP}no header here{CALL_END}"
    out, steps, _ = _answer(model, CALLS_BEGIN + good + bad + CALLS_END + EOS)
    assert [c["function"] for c in out.tool_calls] == [{"name": "get_time", "arguments": "{}"}]
    assert out.text == bad + CALLS_END
    assert out.finish == "tool_calls"
    assert _reassemble(steps) == (out.text, out.tool_calls)


def test_stop_strings_cut_content_but_never_arguments(model: ModelText) -> None:
    args = '{"city": "Paris"}'
    out, _, _ = _answer(model, "Sure." + block(("get_weather", args)), stop=["Paris"])
    assert out.tool_calls[0]["function"]["arguments"] == args
    out, _, _ = _answer(model, "Paris is nice." + block(("get_weather", args)), stop=["Paris"])
    assert (out.text, out.tool_calls, out.finish) == ("", [], "stop")


def test_text_without_a_block_is_plain_content(model: ModelText) -> None:
    out, steps, _ = _answer(model, "The weather in Paris is sunny." + EOS)
    assert (out.text, out.tool_calls, out.finish) == ("The weather in Paris is sunny.", [],
                                                      "stop")
    assert all(not d for _, d in steps)


def test_the_parser_needs_every_marker(model: ModelText) -> None:
    markers = Markers.of(model.codec)
    assert markers is not None and len(markers.all()) == 5
    assert Markers.of(load_model_text("builtin").codec) is None
    with pytest.raises(ValueError):
        assert model.codec is not None
        ToolCallParser(model.codec, markers).feed(markers.sep)


# ---------------------------------------------------------------- the forcing grammar
def _matches(model: ModelText, ckpt: Path, grammar: str, text: str) -> bool:
    """Whether llguidance, under ``grammar``, lets the model write ``text`` to the end."""
    llguidance = pytest.importorskip("llguidance")
    assert model.codec is not None
    tok = llguidance.LLTokenizer((ckpt / "tokenizer.json").read_text(),
                                 n_vocab=model.vocab_size, eos_token=sorted(model.eos_token_ids))
    compiled = llguidance.grammar_from("grammar", grammar)
    assert not llguidance.LLMatcher.validate_grammar(compiled)
    matcher = llguidance.LLMatcher(tok, compiled, log_level=0)
    ok = all(matcher.consume_token(t) for t in model.codec.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


def test_the_grammar_forces_the_block_and_the_schemas(model: ModelText) -> None:
    ckpt = Path(model.source)
    markers = Markers.of(model.codec)
    assert markers is not None
    two = block(("get_weather", '{"city":"Paris","unit":"kelvin"}'), ("get_time", "{}"))
    one = block(("get_time", '{"zone":"CET"}'))
    required = tool_call_grammar([WEATHER, TIME], markers)
    assert _matches(model, ckpt, required, two) and _matches(model, ckpt, required, one)
    for wrong in ["Sure." + EOS,  # prose instead of a call
                  block(("get_weather", '{"unit":"kelvin"}')),  # a required property missing
                  block(("get_weather", '{"city":"Paris","unit":"F"}')),  # not in the enum
                  block(("get_date", "{}")),  # not a tool
                  block(("get_time", '{"zone": "CET"}'))]:  # the whitespace is compact
        assert not _matches(model, ckpt, required, wrong), wrong
    single = tool_call_grammar([WEATHER, TIME], markers, parallel=False)
    assert _matches(model, ckpt, single, one) and not _matches(model, ckpt, single, two)
    named = tool_call_grammar([WEATHER, TIME], markers, named="get_time")
    assert _matches(model, ckpt, named, one)
    assert not _matches(model, ckpt, named, block(("get_weather", '{"city":"Oslo"}')))
    with pytest.raises(ValueError):
        tool_call_grammar([WEATHER], markers, named="get_time")
    # What the grammar lets through, the parser reads back as the same calls.
    out, _, _ = _answer(model, two)
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [
        {"city": "Paris", "unit": "kelvin"}, {}]


def test_required_and_named_choices_carry_the_forcing_grammar(model: ModelText) -> None:
    markers = Markers.of(model.codec)
    assert markers is not None
    auto = _chat(model, tools=[WEATHER, TIME])
    assert "structured" not in auto.sampling
    for extra, named, parallel in [({"tool_choice": "required"}, None, True),
                                   ({"tool_choice": "required", "parallel_tool_calls": False},
                                    None, False),
                                   ({"tool_choice": {"type": "function", "function": {
                                       "name": "get_time"}}}, "get_time", True)]:
        req = _chat(model, tools=[WEATHER, TIME], **extra)
        assert req.tools is not None and req.tools.forced and req.tools.parse
        assert req.sampling["structured"] == {
            "kind": "lark", "value": tool_call_grammar([WEATHER, TIME], markers, named, parallel)}
        assert req.prompt_ids == auto.prompt_ids  # the tools are rendered all the same


def test_strict_under_auto_lets_the_model_choose_but_holds_its_calls_to_the_schema(
        model: ModelText) -> None:
    ckpt = Path(model.source)
    markers = Markers.of(model.codec)
    assert markers is not None
    req = _chat(model, tools=[STRICT_WEATHER, TIME])
    assert req.tools is not None and req.tools.strict and not req.tools.forced
    grammar = req.sampling["structured"]["value"]
    assert req.sampling["structured"]["kind"] == "lark"
    good = block(("get_weather", '{"city":"Paris","unit":"kelvin"}'))
    for text in ["Sunny, 21 degrees." + EOS, good, "Let me look.\n" + good, EOS,
                 block(("get_time", '{"zone":"CET"}'))]:
        assert _matches(model, ckpt, grammar, text), text
    for text in ["Let me look.\n" + block(("get_weather", '{"unit":"kelvin"}')),
                 block(("get_weather", '{"city":"Paris","unit":"F"}')),
                 block(("get_date", "{}")),
                 good + "and more text"]:
        assert not _matches(model, ckpt, grammar, text), text
    single = _chat(model, tools=[STRICT_WEATHER, TIME], parallel_tool_calls=False)
    two = block(("get_weather", '{"city":"Paris"}'), ("get_time", "{}"))
    assert _matches(model, ckpt, grammar, two)
    assert not _matches(model, ckpt, single.sampling["structured"]["value"], two)
    # strict: false, or under none, asks for nothing of the kind.
    loose = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    assert "structured" not in _chat(model, tools=[loose, TIME]).sampling
    assert "structured" not in _chat(model, tools=[STRICT_WEATHER],
                                     tool_choice="none").sampling


ODD = [None, True, 0, -1.5, "", "x", [], [None], [1], ["a"], [[]], {}, {"type": None},
       {"function": []}, [{"type": "function", "function": {"name": None}}],
       [{"type": "function", "function": {"name": "f", "parameters": []}}],
       [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
       [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}]]


@pytest.mark.parametrize("field", ["tools", "tool_choice", "parallel_tool_calls", "tool_calls",
                                   "tool_call_id"])
def test_odd_values_are_answers_or_400s_never_crashes(model: ModelText, field: str) -> None:
    for value in ODD:
        if field in ("tool_calls", "tool_call_id"):
            turn = {"role": "assistant" if field == "tool_calls" else "tool", "content": "x",
                    field: value}
            body: dict[str, Any] = {"messages": [*USER, turn], "tools": [WEATHER]}
        else:
            body = {"messages": USER, "tools": [WEATHER], field: value}
        try:
            parse_request("chat", body, model, "served")
        except ApiError as exc:
            assert exc.status == 400 and exc.param in (field, "tools", "messages"), (value, exc)
