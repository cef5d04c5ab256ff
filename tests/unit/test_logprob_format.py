"""Log-probabilities in OpenAI's shapes (serve/openai/logprob_format.py): completions, chat, vLLM's
prompt_logprobs, from the entries the instances send."""

from __future__ import annotations

from typing import Any

import pytest

from pdd_sidecar.serve.openai.logprob_format import LogprobText, entry_ok, with_first_null
from pdd_sidecar.serve.openai.openai_request import ApiError, parse_request
from pdd_sidecar.serve.openai.text import load_model_text

BUILTIN = load_model_text("builtin")
TEXT = {ord("a"): "a", ord("b"): "b", 0xC3: "\ufffd", ord(" "): " "}


def _decode(ids: list[int]) -> str:
    return "".join(TEXT.get(i, f"<{i}>") for i in ids)


def test_completion_shape_with_an_echoed_prompt_and_the_chosen_token_always_listed() -> None:
    lt = LogprobText(_decode)
    ids = [ord("a"), ord(" "), ord("b")]
    # the chosen "b" is not among the top 1: it is added to its dict, as vLLM does
    entries = with_first_null([[-0.5, 1, [[ord(" "), -0.5]]],
                               [-2.0, 3, [[ord("a"), -0.1]]]])
    got = lt.completion(ids, entries)
    assert got == {"tokens": ["a", " ", "b"], "token_logprobs": [None, -0.5, -2.0],
                   "top_logprobs": [None, {" ": -0.5}, {"a": -0.1, "b": -2.0}],
                   "text_offset": [0, 1, 2]}
    # a stream's next chunk goes on from where this one ended
    more = lt.completion([ord("a")], [[-0.3, 1, []]])
    assert more["text_offset"] == [3] and more["top_logprobs"] == [{"a": -0.3}]


def test_chat_shape_has_bytes_and_a_top_list() -> None:
    lt = LogprobText(_decode)
    got = lt.chat([0xC3, ord("a")], [[-1.5, 2, [[ord("a"), -0.5], [0xC3, -1.5]]],
                                     [-0.25, 1, []]])
    first, second = got["content"]
    assert first == {"token": "\ufffd", "logprob": -1.5, "bytes": [0xEF, 0xBF, 0xBD],
                     "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                      {"token": "\ufffd", "logprob": -1.5,
                                       "bytes": [0xEF, 0xBF, 0xBD]}]}
    assert second["top_logprobs"] == [] and second["logprob"] == -0.25


def test_tokens_as_ids_and_a_model_without_a_tokenizer() -> None:
    for lt in (LogprobText(_decode, as_ids=True), LogprobText(None)):
        got = lt.completion([7], [[-1.0, 4, [[9, -0.5]]]])
        assert got["tokens"] == ["token_id:7"]
        assert got["top_logprobs"] == [{"token_id:9": -0.5, "token_id:7": -1.0}]


def test_vllm_prompt_logprobs_by_token_id_with_ranks() -> None:
    lt = LogprobText(_decode)
    got = lt.prompt_logprobs([ord("a"), ord("b")], with_first_null([[-3.0, 5, [[ord("a"), -0.2]]]]))
    assert got == [None, {"97": {"logprob": -0.2, "rank": 1, "decoded_token": "a"},
                          "98": {"logprob": -3.0, "rank": 5, "decoded_token": "b"}}]


@pytest.mark.parametrize("entry", [None, [], [-1.0, 1], [-1.0, True, []], ["x", 1, []],
                                   [-1.0, 1, [[1]]], [-1.0, 1, [["a", -1.0]]], [-1, 1, {}]])
def test_malformed_entries_are_caught(entry: Any) -> None:
    assert not entry_ok(entry)
    assert entry_ok([-1.0, 1, [[3, -1.0], [4, -2]]])


def _parse(kind: str, body: dict[str, Any]) -> Any:
    base = {"prompt": "ab"} if kind == "completion" else {
        "messages": [{"role": "user", "content": "hi"}]}
    return parse_request(kind, {**base, **body}, BUILTIN, "served")


def test_requests_ask_for_what_each_endpoint_spells() -> None:
    req = _parse("completion", {"logprobs": 3})
    assert (req.logprobs, req.echo, req.prompt_logprobs) == (3, False, None)
    req = _parse("completion", {"logprobs": 0, "echo": True, "max_tokens": 0})
    assert (req.logprobs, req.echo, req.prompt_logprobs, req.max_tokens) == (0, True, 0, 0)
    assert req.prompt_text == "ab"
    req = _parse("completion", {"logprobs": 2, "echo": True, "prompt_logprobs": 5})
    assert (req.prompt_logprobs, req.vllm_prompt_logprobs) == (5, True)
    req = _parse("completion", {"echo": True})  # the prompt's text only: nothing to compute
    assert (req.logprobs, req.prompt_logprobs) == (None, None)
    assert _parse("completion", {"logprobs": False}).logprobs is None
    req = _parse("chat", {"logprobs": True, "top_logprobs": 4})
    assert (req.logprobs, req.prompt_logprobs) == (4, None)
    assert _parse("chat", {"logprobs": True}).logprobs == 0
    assert _parse("chat", {"logprobs": False, "top_logprobs": 0}).logprobs is None


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completion", {"max_tokens": 0}, "max_tokens"),  # only with echo
    ("completion", {"echo": True, "max_tokens": -1}, "max_tokens"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 2}, "logprobs"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
])
def test_bad_logprob_fields_are_400s_naming_them(kind: str, body: dict[str, Any],
                                                  param: str) -> None:
    with pytest.raises(ApiError) as err:
        _parse(kind, body)
    assert (err.value.status, err.value.param) == (400, param)
