"""The router's text side without any server: validation, stop strings, detokenizing, templates.

Pure Python (tokenizers, jinja2, aiohttp): no torch, no transformers. The comparison with
transformers' apply_chat_template lives in tests/dataplane/test_openai_api.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdd_sidecar.env import ConfigError, RouterSettings
from pdd_sidecar.serve.openai.completion_output import Output
from pdd_sidecar.serve.openai.openai_request import ApiError, parse_request
from pdd_sidecar.serve.openai.text import (
    ByteCodec,
    IncrementalDetokenizer,
    ModelText,
    StopStrings,
    TemplateRenderError,
    TextConfigError,
    load_model_text,
    render_chat,
)

BUILTIN = load_model_text("builtin")
CORPUS = ["Hello world, this is a test of the stop strings. héllo ünïcode 日本語 🙂 ok"] * 20


def _bpe_dir(tmp: Path, with_tokenizer: bool = True) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if with_tokenizer:
        tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
                         "{{ m['content'] }}\n{% endfor %}"}))
    (tmp / "config.json").write_text(json.dumps({"vocab_size": 380,
                                                 "max_position_embeddings": 100,
                                                 "eos_token_id": 1}))
    return tmp


def _codec(tmp: Path) -> Any:
    model = load_model_text(str(_bpe_dir(tmp)))
    assert model.codec is not None
    return model.codec


# ---------------------------------------------------------------- validation
def _parse(body: dict[str, Any], kind: str = "completion", model: ModelText = BUILTIN) -> Any:
    return parse_request(kind, body, model, "served-name")


BAD_FIELDS = [
    ({"prompt": [1], "max_tokens": True}, "max_tokens"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1], "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": [1], "max_tokens": "3"}, "max_tokens"),
    ({"prompt": [1], "temperature": 2.5}, "temperature"),
    ({"prompt": [1], "temperature": -0.1}, "temperature"),
    ({"prompt": [1], "temperature": True}, "temperature"),
    ({"prompt": [1], "top_p": 0}, "top_p"),
    ({"prompt": [1], "top_p": 1.01}, "top_p"),
    ({"prompt": [1], "top_k": -2}, "top_k"),
    ({"prompt": [1], "top_k": 1.5}, "top_k"),
    ({"prompt": [1], "seed": "7"}, "seed"),
    ({"prompt": [1], "seed": 2**64}, "seed"),
    ({"prompt": [1], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": [1], "stop": [1]}, "stop"),
    ({"prompt": [1], "stop_token_ids": [256]}, "stop_token_ids"),
    ({"prompt": [1], "stop_token_ids": "1"}, "stop_token_ids"),
    ({"prompt": [1], "stream": "yes"}, "stream"),
    ({"prompt": [1], "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": [1], "n": 17}, "n"),
    ({"prompt": [1], "n": 0}, "n"),
    ({"prompt": [1], "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": [1], "n": True}, "n"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [1], "logprobs": 21}, "logprobs"),
    ({"prompt": [1], "logprobs": True}, "logprobs"),
    ({"prompt": [1], "echo": 1}, "echo"),
    ({"prompt": [1], "model": 5}, "model"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 256]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [True, 1]}, "prompt"),
    ({"prompt": [1, 2.0]}, "prompt"),
    ({"prompt": [0, 255, 256]}, "prompt"),
    ({"prompt": [1], "user_tags": [1, 2.5, None, ["\ud800"]]}, "user_tags"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": [1], "stop": "\udc00"}, "stop"),
    ({"prompt": [1], "max_tokens": 8192}, "max_tokens"),
    ({"prompt": [1] * 8192}, "prompt"),
]


@pytest.mark.parametrize(("body", "field"), BAD_FIELDS,
                         ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_FIELDS)])
def test_each_bad_field_is_a_400_naming_it(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as err:
        _parse(body)
    assert err.value.status == 400
    assert err.value.param == field
    assert field in err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_token_id_prompts_pass_whole_at_the_vocabulary_edges() -> None:
    assert _parse({"prompt": [0, 255, 7]}).prompt_ids == [0, 255, 7]
    assert _parse({"prompt": [[3, 4]]}).prompt_ids == [3, 4]  # a batch of one


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x\ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools"),
]


@pytest.mark.parametrize(("body", "field"), BAD_CHAT,
                         ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_CHAT)])
def test_bad_chat_fields_are_400s_naming_them(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ApiError) as err:
        _parse(body, "chat")
    assert (err.value.status, err.value.param) == (400, field)


def test_error_messages_quote_huge_values_briefly() -> None:
    for body in ({"prompt": [1], "max_tokens": [7] * 100000},
                 {"prompt": [1], "stop": ["x" * 100000] * 5},
                 {"prompt": [1], "model": "m" * 100000}):
        with pytest.raises(ApiError) as err:
            _parse(body)
        assert len(err.value.message) < 300


def test_length_limit_names_the_limit() -> None:
    limit = BUILTIN.max_model_len
    assert _parse({"prompt": [1] * 10, "max_tokens": limit - 10}).max_tokens == limit - 10
    with pytest.raises(ApiError) as err:
        _parse({"prompt": [1] * 10, "max_tokens": limit - 9})
    assert str(limit) in err.value.message and err.value.param == "max_tokens"
    small = load_model_text("builtin", max_model_len=32)
    with pytest.raises(ApiError) as err:
        parse_request("completion", {"prompt": [1] * 20, "max_tokens": 13}, small, "m")
    assert "32" in err.value.message


def test_a_chat_without_max_tokens_runs_up_to_the_length_served() -> None:
    """The instances may hold less than the checkpoint's limit: a chat that sets no max_tokens
    gets what the router serves (/v1/models), not a default every instance would refuse."""
    limit = BUILTIN.max_model_len
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    whole = parse_request("chat", chat, BUILTIN, "m")
    prompt = len(whole.prompt_ids)
    assert whole.max_tokens == limit - prompt
    assert parse_request("chat", chat, BUILTIN, "m", 100).max_tokens == 100 - prompt
    assert parse_request("chat", chat, BUILTIN, "m", limit + 500).max_tokens == limit - prompt
    assert parse_request("chat", chat, BUILTIN, "m", 2).max_tokens == 1  # refused later, by KV
    set_one = parse_request("chat", {**chat, "max_tokens": 7}, BUILTIN, "m", 100)
    assert set_one.max_tokens == 7
    assert parse_request("completion", {"prompt": [1, 2]}, BUILTIN, "m", 100).max_tokens == 16


def test_unknown_model_is_a_404_and_the_served_name_is_accepted() -> None:
    with pytest.raises(ApiError) as err:
        _parse({"prompt": [1], "model": "other"})
    assert err.value.status == 404 and err.value.param == "model"
    assert _parse({"prompt": [1], "model": "served-name"}).prompt_ids == [1]


def test_good_request_carries_sampling_and_a_seed() -> None:
    req = _parse({"prompt": [["a", "b"]][0][:1], "temperature": 0, "top_p": 0.5, "top_k": 3,
                  "seed": 11, "stop": "x", "stop_token_ids": [7], "ignore_eos": True})
    assert req.prompt_ids == [ord("a")]
    assert req.sampling == {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "seed": 11}
    assert (req.stop, req.stop_token_ids, req.ignore_eos) == (["x"], [7], True)
    seeds = {_parse({"prompt": [1]}).sampling["seed"] for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert _parse({"prompt": [[5, 6]]}).prompt_ids == [5, 6]
    assert _parse({"prompt": [1]}).sampling["temperature"] == 1.0


def test_text_without_a_tokenizer_json_is_refused(tmp_path: Path) -> None:
    model = load_model_text(str(_bpe_dir(tmp_path, with_tokenizer=False)))
    assert model.codec is None and model.vocab_size == 380 and model.max_model_len == 100
    with pytest.raises(ApiError) as err:
        parse_request("completion", {"prompt": "hello"}, model, "m")
    assert err.value.status == 400 and "tokenizer.json" in err.value.message
    with pytest.raises(ApiError) as err:
        parse_request("chat", {"messages": [{"role": "user", "content": "hi"}]}, model, "m")
    assert err.value.status == 400 and "tokenizer.json" in err.value.message
    assert parse_request("completion", {"prompt": [379]}, model, "m").prompt_ids == [379]
    with pytest.raises(ApiError):
        parse_request("completion", {"prompt": [380]}, model, "m")


def test_eos_ids_come_from_config_and_generation_config(tmp_path: Path) -> None:
    _bpe_dir(tmp_path)
    assert load_model_text(str(tmp_path)).eos_token_ids == {1}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 7]}')
    model = load_model_text(str(tmp_path))
    assert model.eos_token_ids == {1, 7}
    req = parse_request("completion", {"prompt": [2]}, model, "m")
    assert req.local_stop_ids == {1, 7}
    req = parse_request("completion", {"prompt": [2], "ignore_eos": True,
                                       "stop_token_ids": [3]}, model, "m")
    assert req.local_stop_ids == {3}


def test_bad_model_source_refuses_to_load(tmp_path: Path) -> None:
    with pytest.raises(TextConfigError, match="config.json"):
        load_model_text(str(tmp_path))
    (tmp_path / "config.json").write_text('{"vocab_size": true}')
    with pytest.raises(TextConfigError, match="vocab_size"):
        load_model_text(str(tmp_path))


def test_router_settings_read_the_model_and_limits() -> None:
    env = {"PDD_PREFILL_URLS": "a:1", "PDD_DECODE_URLS": "b:2", "PDD_MODEL_NAME": "m",
           "PDD_MODEL_SOURCE": "/x", "PDD_MAX_MODEL_LEN": "77",
           "PDD_ROUTER_MAX_BODY_BYTES": "4096"}
    s = RouterSettings.from_env(env)
    assert (s.model_name, s.model_source, s.max_model_len, s.max_body_bytes) == (
        "m", "/x", 77, 4096)
    with pytest.raises(ConfigError, match="PDD_MAX_MODEL_LEN"):
        RouterSettings.from_env({**env, "PDD_MAX_MODEL_LEN": "big"})


# ---------------------------------------------------------------- stops and detokenizing
def test_stop_strings_match_across_deltas_and_hold_back_only_possible_starts() -> None:
    s = StopStrings(["STOP", "xyz"])
    assert s.feed("ab") == ("ab", False)
    assert s.feed("cS") == ("c", False)  # "S" may start "STOP"
    assert s.feed("Tx") == ("ST", False)  # "STx" is no stop; "x" may start "xyz"
    assert s.feed("y") == ("", False)
    assert s.feed("zz") == ("", True)
    s = StopStrings(["lo w", "o"])
    assert s.feed("hello world") == ("hel", True)  # the earliest match wins
    s = StopStrings(["end"])
    assert s.feed("the en") == ("the ", False)
    assert s.flush() == "en"


def _feed(out: Output, data: bytes) -> str:
    """Tokens until the output finishes, as Router.generate feeds them."""
    shown = ""
    for b in data:
        shown += out.add(b)
        if out.finish:
            break
    return shown


def _output(stop: list[str], max_tokens: int, stop_ids: frozenset[int] = frozenset()) -> Output:
    req = _parse({"prompt": [1], "stop": stop, "max_tokens": max_tokens})
    req.local_stop_ids = stop_ids
    return Output(req, BUILTIN)


def test_output_truncates_before_a_stop_string_and_keeps_its_tokens() -> None:
    out = _output(["STOP"], 50)
    shown = _feed(out, b"one two STOP three")
    assert shown == out.text == "one two "
    assert out.finish == "stop" and out.stopped_by_string
    assert bytes(out.token_ids) == b"one two STOP"


def test_stop_strings_are_looked_for_only_after_min_tokens() -> None:
    out = _output(["ab"], 50)
    out.req.min_tokens = 4
    # The first four tokens' text is shown as it is; the search starts in the fifth's.
    shown = _feed(out, b"abxabyabz")
    assert shown == out.text == "abxaby" and out.finish == "stop"
    assert bytes(out.token_ids) == b"abxabyab"
    out = _output(["ab"], 50)
    assert _feed(out, b"abxab") == "" and bytes(out.token_ids) == b"ab"


def test_output_finishes_on_length_and_on_stop_ids() -> None:
    out = _output(["zz"], 5)
    shown = _feed(out, b"abcdzzz")
    assert (shown, out.text, out.finish) == ("abcdz", "abcdz", "length")
    out = _output([], 50, frozenset({ord("!")}))
    shown = _feed(out, b"hey!you")
    assert (shown, out.finish, out.token_ids) == ("hey", "stop", list(b"hey!"))
    out = _output([], 50)
    for b in b"ab":
        out.add(b)
    assert out.end(None) == "" and out.finish == "length"  # pre-v2 instances: no reason
    out = _output([], 50, frozenset({ord("b")}))
    out.add(ord("a"))
    assert out.end("stop") == "" and out.finish == "stop"


@pytest.mark.parametrize("text", ["Hello world 日本語🙂 héllo", "🙂🙂 ok", "plain"])
def test_incremental_detokenizing_equals_whole_decoding(tmp_path: Path, text: str) -> None:
    for codec in (_codec(tmp_path), ByteCodec()):
        ids = codec.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(codec, codec.encode("prompt:", add_special_tokens=False))
        parts = [detok.add(t) for t in ids]
        assert "".join(parts) + detok.flush() == codec.decode(ids) == text
        assert not any("\ufffd" in p for p in parts)


def test_an_incomplete_character_is_flushed_at_the_end() -> None:
    codec = ByteCodec()
    detok = IncrementalDetokenizer(codec, [])
    ids = list("é".encode())[:1]
    assert detok.add(ids[0]) == ""
    assert detok.flush() == "\ufffd"


# ---------------------------------------------------------------- templates
def test_template_helpers_behave_as_transformers_defines_them() -> None:
    t = ("{% for m in messages %}{{ m | tojson }}{% if loop.index == 1 %}{% break %}{% endif %}"
         "{% endfor %}{% set ns = namespace(n=1) %}{{ ns.n }}{{ strftime_now('%Y')|length }}")
    assert render_chat(t, [{"role": "user", "content": "<é>"}, {"role": "x", "content": "y"}],
                       {}) == '{"role": "user", "content": "<é>"}14'
    with pytest.raises(TemplateRenderError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", [], {})
    with pytest.raises(TemplateRenderError):
        render_chat("{{ ''.__class__.__mro__ }}", [], {})
    with pytest.raises(TemplateRenderError):
        render_chat("{% set ns = namespace(_x=1) %}", [], {})
    # None values are dropped (so `is defined` checks work) and reasoning fields aliased.
    t = "{% for m in messages %}{{ m.content is defined }}{{ m.reasoning_content }}{% endfor %}"
    assert render_chat(t, [{"role": "a", "content": None, "thinking": "hm"}], {}) == "Falsehm"
    # trim_blocks / lstrip_blocks and add_generation_prompt
    t = "  {% if add_generation_prompt %}\nA:{% endif %}\n{{ bos_token }}"
    assert render_chat(t, [], {"bos_token": "<s>"}) == "A:<s>"


def test_checkpoint_special_tokens_and_template_load(tmp_path: Path) -> None:
    codec = _codec(tmp_path)
    assert codec.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    ids = codec.encode(render_chat(codec.chat_template, [{"role": "user", "content": "Hello"}],
                                   codec.special_tokens), add_special_tokens=False)
    assert ids[0] == 0 and codec.decode(ids) == "user: Hello\n"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    codec = _codec(tmp_path)
    assert codec.chat_template == "J{{ messages[0]['content'] }}"
