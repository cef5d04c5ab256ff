"""The router's table of request fields: refused unless off, accepted without effect, unknown
refused; and docs/openai-api.md listing the same table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pdd_sidecar.serve.openai.openai_fields import FIELDS, HONOURED, NO_EFFECT, REFUSED
from pdd_sidecar.serve.openai.openai_request import ApiError, parse_request
from pdd_sidecar.serve.openai.text import load_model_text

BUILTIN = load_model_text("builtin")
DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
BASE = {"completion": {"prompt": [1]},
        "chat": {"messages": [{"role": "user", "content": "hi"}]}}


def _parse(kind: str, extra: dict[str, Any]) -> Any:
    return parse_request(kind, {**BASE[kind], **extra}, BUILTIN, "served")


def _refused(kind: str, extra: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as err:
        _parse(kind, extra)
    return err.value


# What the issue found accepted and ignored, and what clients send beside it: each asks for
# something pdd does not do, and must be a 400 naming the field.
ASKING = [
    ("completion", "min_p", 0.1),
    ("completion", "suffix", "tail"),
    ("completion", "best_of", 3),
    ("completion", "use_beam_search", True),
    ("chat", "functions", [{"name": "f"}]),  # tools: tests/unit/test_tool_calls.py
    ("chat", "function_call", {"name": "f"}),
    ("chat", "reasoning_effort", "low"),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "chat_template", "{{ x }}"),
    ("completion", "skip_special_tokens", False),
    ("completion", "include_stop_str_in_output", True),
    ("completion", "cache_salt", "tenant-a"),
    ("completion", "allowed_token_ids", [1, 2]),
    ("chat", "store", True),  # nothing is stored
    ("completion", "guided_whitespace_pattern", r"[\n ]*"),  # vLLM lays its JSON out by it
]


@pytest.mark.parametrize(("kind", "field", "value"), ASKING,
                         ids=[f"{k}-{f}-{i}" for i, (k, f, _) in enumerate(ASKING)])
def test_a_field_that_asks_for_what_pdd_does_not_do_is_a_400_naming_it(
        kind: str, field: str, value: Any) -> None:
    err = _refused(kind, {field: value})
    assert (err.status, err.param) == (400, field)
    assert err.message.startswith(f"{field}: ")
    assert err.body()["error"]["type"] == "invalid_request_error"
    if len(repr(value)) <= 60:
        assert repr(value) in err.message


OFF = [
    ("completion", {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
                    "logit_bias": {}, "min_tokens": 0, "min_p": 0, "n": 1, "best_of": 1,
                    "echo": False, "suffix": "", "logprobs": None, "response_format":
                        {"type": "text"}, "use_beam_search": False, "length_penalty": 1.0,
                    "skip_special_tokens": True, "add_special_tokens": True,
                    "include_stop_str_in_output": False, "bad_words": []}),
    ("chat", {"logit_bias": None, "logprobs": False, "top_logprobs": 0, "tools": [],
              "tool_choice": "none", "functions": [], "function_call": "auto",
              "modalities": ["text"], "continue_final_message": False, "echo": False,
              "chat_template_kwargs": {}, "guided_json": None, "response_format": None}),
    ("completion", {"user": "u1", "metadata": {"a": "b"}, "store": False,
                    "service_tier": "auto", "prompt_cache_key": "k", "priority": 3,
                    "request_id": "mine", "return_token_ids": True,
                    "guided_decoding_backend": "xgrammar"}),
    ("chat", {"user": "u1", "parallel_tool_calls": False, "safety_identifier": "s",
              "prediction": {"type": "content", "content": "x"}, "store": None,
              "guided_whitespace_pattern": None}),
    ("chat", {"stream": True, "stream_options": {"include_usage": False,
                                                 "continuous_usage_stats": False},
              "max_tokens": 5, "max_completion_tokens": 5}),
]


@pytest.mark.parametrize(("kind", "extra"), OFF, ids=[f"{k}-{i}" for i, (k, _) in
                                                      enumerate(OFF)])
def test_values_that_ask_for_nothing_and_fields_without_effect_pass(
        kind: str, extra: dict[str, Any]) -> None:
    req = _parse(kind, extra)
    assert req.sampling.keys() == {"temperature", "top_p", "top_k", "seed"}


# Fields whose value is read but whose shape was not checked, or whose keys were not: each
# malformed or unsupported body is a 400 naming the field and quoting what is wrong.
MALFORMED = [
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "include_usgae": True}},
     "stream_options", "include_usgae"),
    ("completion", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options", "continuous_usage_stats"),
    ("chat", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options", "'yes'"),
    ("completion", {"stream": True, "stream_options": ["include_usage"]},
     "stream_options", "['include_usage']"),
    ("chat", {"max_tokens": 64, "max_completion_tokens": 8}, "max_completion_tokens", "64"),
    ("chat", {"max_tokens": "64", "max_completion_tokens": 8}, "max_tokens", "'64'"),
    ("chat", {"max_tokens": 8, "max_completion_tokens": 8.0}, "max_completion_tokens", "8.0"),
    ("completion", {"max_tokens": True}, "max_tokens", "True"),
]


@pytest.mark.parametrize(("kind", "extra", "field", "shown"), MALFORMED,
                         ids=[f"{k}-{f}-{i}" for i, (k, _, f, _) in enumerate(MALFORMED)])
def test_malformed_or_unsupported_values_are_400s_naming_the_field(
        kind: str, extra: dict[str, Any], field: str, shown: str) -> None:
    err = _refused(kind, extra)
    assert (err.status, err.param) == (400, field)
    assert err.message.startswith(field) and shown in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_the_known_stream_options_and_one_limit_under_two_names_are_read() -> None:
    usage = _parse("chat", {"stream": True, "stream_options": {"include_usage": True}})
    assert usage.include_usage
    assert not _parse("chat", {"stream": True, "stream_options": {}}).include_usage
    both = _parse("chat", {"max_tokens": 7, "max_completion_tokens": 7})
    assert both.max_tokens == 7
    assert _parse("chat", {"max_completion_tokens": 9}).max_tokens == 9
    assert _parse("chat", {"max_tokens": 11}).max_tokens == 11


@pytest.mark.parametrize(("kind", "field"), [("completion", "temprature"),
                                             ("chat", "max_token"),
                                             ("completion", "messages"),
                                             ("chat", "prompt"),
                                             ("chat", "suffix"),
                                             ("completion", "regex")])
def test_unknown_fields_and_fields_of_the_other_endpoint_are_refused(kind: str,
                                                                      field: str) -> None:
    err = _refused(kind, {field: 1})
    assert (err.status, err.param) == (400, field)
    assert field in err.message


def test_a_long_value_is_not_quoted() -> None:
    err = _refused("chat", {"allowed_token_ids": list(range(50))})
    assert err.param == "allowed_token_ids" and "got" not in err.message
    assert len(err.message) < 100


def _doc_sections() -> dict[str, set[str]]:
    """The fields each section's bullets are about (backticked names before the first
    colon of a bullet)."""
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    bullet = ""

    def close() -> None:
        if current is not None and bullet:
            current.update(re.findall(r"`([a-z_]+)`", bullet.split(": ", 1)[0]))

    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            close()
            bullet = ""
            current = sections.setdefault(line[3:].strip(), set())
        elif line.startswith("- "):
            close()
            bullet = line[2:]
        elif line.startswith("  ") and bullet:
            bullet += " " + line.strip()
        else:
            close()
            bullet = ""
    close()
    return sections


def test_the_docs_list_the_same_table() -> None:
    sections = _doc_sections()
    want = {"Honoured": HONOURED, "Accepted without effect": NO_EFFECT,
            "Refused unless off": REFUSED}
    assert set(want) <= set(sections)
    for title, effect in want.items():
        table = {name for name, f in FIELDS.items() if f.effect == effect}
        assert sections[title] == table, title


# ---------------------------------------------------------------- the sampling controls
BAD_CONTROLS = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.5}, "repetition_penalty"),
    ({"repetition_penalty": 1e309}, "repetition_penalty"),  # inf, as json reads it
    ({"repetition_penalty": 1e7}, "repetition_penalty"),  # float32 logits would overflow
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"logit_bias": {"256": 1}}, "logit_bias"),  # outside the byte vocabulary
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": [[5, 1]]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens (16)
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
]


@pytest.mark.parametrize(("extra", "field"), BAD_CONTROLS,
                         ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_CONTROLS)])
def test_out_of_range_controls_are_400s_naming_the_field(extra: dict[str, Any],
                                                         field: str) -> None:
    err = _refused("completion", extra)
    assert (err.status, err.param) == (400, field)
    assert field in err.message and len(err.message) < 300


def test_controls_travel_in_sampling_only_when_they_ask_for_something() -> None:
    req = _parse("completion", {"presence_penalty": 0.5, "frequency_penalty": -1,
                                "repetition_penalty": 1.3, "logit_bias": {"7": 100, "9": 0,
                                                                          "10": -2.5},
                                "min_tokens": 4, "max_tokens": 8})
    assert {k: v for k, v in req.sampling.items() if k not in ("seed",)} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.5,
        "frequency_penalty": -1.0, "repetition_penalty": 1.3,
        "logit_bias": {"7": 100.0, "10": -2.5}, "min_tokens": 4}
    assert req.min_tokens == 4
    chat = _parse("chat", {"min_tokens": 3, "max_completion_tokens": 3})
    assert chat.sampling["min_tokens"] == 3 and chat.min_tokens == 3

