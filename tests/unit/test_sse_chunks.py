"""A stream's events from the template are byte for byte json.dumps of the reference chunk,
for any text (quotes, escapes, non-ASCII, lone surrogates' replacements), any tokens, both
kinds, with and without the usage field; a step that ends the stream carries its extras."""

from __future__ import annotations

import json
import random

import pytest

from pdd_sidecar.serve.openai.sse_chunks import ChunkFormat, sse

TEXTS = ["", " hello", 'say "hi"\n', "tab\there \\ back", "héllo ünïcode 日本語 🙂", "\x00\x1f",
         "\ufffd", "</script>", "a" * 300]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("usage", [False, True])
def test_the_template_is_the_reference(kind: str, usage: bool) -> None:
    rng = random.Random(len(kind) + usage)
    fmt = ChunkFormat('cmpl-"x"\\1', kind, 1796180000, "deep/seek ü", usage)
    for text in TEXTS:
        for tokens in ([], [0], [rng.randrange(1 << 20) for _ in range(rng.randrange(1, 9))]):
            got = fmt.step(tokens, text, None)
            assert got == sse(fmt.chunk(fmt.choice(tokens, text, None))), (text, tokens)
            event = json.loads(got.decode()[len("data: "):])
            assert event["choices"][0]["token_ids"] == tokens
            assert ("usage" in event) == usage and event["object"] == fmt.obj
            shown = event["choices"][0]["text" if kind == "completion" else "delta"]
            assert shown == (text if kind == "completion" else {"content": text})


def test_a_finishing_step_carries_its_extras_and_an_empty_chat_delta() -> None:
    chat = ChunkFormat("c", "chat", 1, "m", False)
    event = json.loads(chat.step([7], "", "stop", {"pdd": {"prefill": "p"}})[6:])
    assert event["choices"][0]["delta"] == {} and event["choices"][0]["finish_reason"] == "stop"
    assert event["pdd"] == {"prefill": "p"}
    role = json.loads(chat.role()[6:])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    done = json.loads(ChunkFormat("c", "completion", 1, "m", True).step([], "", "length")[6:])
    assert done["choices"][0]["finish_reason"] == "length" and done["usage"] is None


def test_a_tool_step_carries_its_deltas_and_any_content() -> None:
    chat = ChunkFormat("c", "chat", 1, "m", True)
    head = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": ""}}
    event = json.loads(chat.tool_step([5, 6], "", [head], None)[6:])
    assert event["choices"][0]["delta"] == {"tool_calls": [head]}
    assert event["choices"][0]["token_ids"] == [5, 6] and event["usage"] is None
    more = {"index": 0, "function": {"arguments": '{"a"'}}
    event = json.loads(chat.tool_step([7], "x", [more], "tool_calls", {"pdd": {"k": 1}})[6:])
    assert event["choices"][0]["delta"] == {"content": "x", "tool_calls": [more]}
    assert event["choices"][0]["finish_reason"] == "tool_calls" and event["pdd"] == {"k": 1}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_choices_events_carry_its_index(kind: str) -> None:
    fmt = ChunkFormat("c", kind, 1, "m", True)
    for index in (0, 1, 15, 63):
        got = fmt.step([5], "x", None, index=index)
        assert got == sse(fmt.chunk(fmt.choice([5], "x", None, index=index)))
        assert json.loads(got[6:])["choices"][0]["index"] == index
        done = json.loads(fmt.step([], "", "length", {"pdd": {}}, index=index)[6:])
        assert done["choices"][0]["index"] == index
        assert json.loads(fmt.role(index)[6:])["choices"][0]["index"] == index
        if kind == "chat":
            call = {"index": 0, "function": {"arguments": "{}"}}
            event = json.loads(fmt.tool_step([5], "", [call], None, index=index)[6:])
            assert event["choices"][0]["index"] == index
