"""Structured output's request side: every form clients send read into one canonical spec, each
distinct spec compiled once, and what the engine cannot compile a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from pdd_sidecar import grammar
from pdd_sidecar.grammar import GrammarCache, GrammarError, Spec, parse_spec
from pdd_sidecar.serve.openai.openai_request import ApiError, parse_request
from pdd_sidecar.serve.openai.structured_request import StructuredError, structured_spec
from pdd_sidecar.serve.openai.text import load_model_text

BUILTIN = load_model_text("builtin")
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["b", "a"]}

FORMS = [
    ({"response_format": {"type": "json_object"}}, ("json_object", None)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     ("json_schema", SCHEMA)),
    ({"guided_json": SCHEMA}, ("json_schema", SCHEMA)),
    ({"guided_json": '{"type": "object", "properties": {"b": {"type": "integer"}, "a": '
                     '{"type": "string"}}, "required": ["b", "a"]}'}, ("json_schema", SCHEMA)),
    ({"guided_regex": "[a-z]{3}"}, ("regex", "[a-z]{3}")),
    ({"guided_choice": ["yes", "no"]}, ("choice", ["yes", "no"])),
    ({"guided_grammar": 'start: "a" "b"+'}, ("lark", 'start: "a" "b"+')),
    ({"guided_grammar": 'root ::= "a" "b"+'}, ("lark", 'root ::= "a" "b"+')),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", SCHEMA)),
    ({"structured_outputs": {"regex": "x+"}}, ("regex", "x+")),
    ({"structured_outputs": {"choice": ["a"]}}, ("choice", ["a"])),
    ({"structured_outputs": {"grammar": 'start: "z"'}}, ("lark", 'start: "z"')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", None)),
]


@pytest.mark.parametrize(("fields", "want"), FORMS, ids=[str(i) for i in range(len(FORMS))])
def test_each_form_becomes_the_instances_spec(fields: dict[str, Any],
                                              want: tuple[str, Any]) -> None:
    for kind in ("completion", "chat"):
        base = {"prompt": [1]} if kind == "completion" else {
            "messages": [{"role": "user", "content": "hi"}]}
        req = parse_request(kind, {**base, **fields}, BUILTIN, "served")
        got = req.sampling["structured"]
        assert (got["kind"], got["value"]) == want
        assert parse_spec(got) == structured_spec(fields)  # the instances read the same spec


def test_no_structured_field_sends_nothing() -> None:
    req = parse_request("completion", {"prompt": [1], "response_format": {"type": "text"},
                                       "structured_outputs": {}}, BUILTIN, "served")
    assert "structured" not in req.sampling


def test_the_schema_keeps_its_key_order_and_equal_specs_are_one_key() -> None:
    a = structured_spec({"guided_json": SCHEMA})
    b = structured_spec({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": dict(SCHEMA)}}})
    assert a == b and hash(a) == hash(b)
    assert a is not None and a.text.index('"b"') < a.text.index('"a"')  # the order out
    swapped = structured_spec({"guided_json": {**SCHEMA, "properties": {
        "a": {"type": "string"}, "b": {"type": "integer"}}}})
    assert swapped != a


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"guided_json": [1]}, "guided_json", "object"),
    ({"guided_regex": "(("}, "guided_regex", "regex"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "strings"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs", "true"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "only one"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_what_cannot_be_compiled_is_a_400_naming_the_field(fields: dict[str, Any], param: str,
                                                          says: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_request("completion", {"prompt": [1], **fields}, BUILTIN, "served")
    assert (err.value.status, err.value.param) == (400, param)
    assert err.value.message.startswith(f"{param}") and says in err.value.message
    with pytest.raises(StructuredError):
        structured_spec(fields)


def test_a_spec_is_compiled_once_and_its_failure_cached_too() -> None:
    cache = GrammarCache(size=2)
    specs = [Spec("regex", "a+"), Spec("regex", "b+"), Spec("regex", "c+")]
    for _ in range(3):
        cache.get(specs[0])
    assert cache.compiled == 1
    bad = Spec("regex", "((")
    for _ in range(2):
        with pytest.raises(GrammarError):
            cache.get(bad)
    assert cache.compiled == 2
    cache.get(specs[1])  # the least recently used (specs[0]) goes
    cache.get(specs[2])
    assert len(cache) == 2
    cache.get(specs[0])
    assert cache.compiled == 5


def test_the_router_checks_each_distinct_spec_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = GrammarCache()
    monkeypatch.setattr(grammar, "_ROUTER_CACHE", cache)
    body = {"prompt": [1], "guided_json": {"type": "object", "properties": {"q": {}}}}
    for _ in range(4):
        parse_request("completion", body, BUILTIN, "served")
    assert cache.compiled == 1


@pytest.mark.parametrize("raw", [5, {"kind": "xml", "value": "a"},
                                 {"kind": "regex", "value": 3},
                                 {"kind": "json_schema", "value": "{}"},
                                 {"kind": "lark", "value": "x" * (grammar.MAX_GRAMMAR_CHARS + 1)}])
def test_the_instances_refuse_a_malformed_spec(raw: Any) -> None:
    from pdd_sidecar.engine.sampling import SamplingError, SamplingParams

    with pytest.raises(SamplingError, match="sampling.structured"):
        SamplingParams.parse({"structured": raw})
