"""Every request field the router knows, in one table: honoured, accepted without effect, or
refused unless it asks for nothing.

Why: a field that changes the answer and is not acted on would come back as a 200 that ignored
it, a wrong answer. So each field OpenAI's API (completions and chat) and vLLM's extensions
define is here with what pdd does with it; a refused field still passes when its value asks
for what pdd does anyway (`min_p: 0`, `suffix: ""`),
and null always does (OpenAI reads null as absent). A field not in the table is refused as
OpenAI refuses it: a misspelt `temprature` or another server's extension must not pass
silently. docs/openai-api.md lists the same table for users; a unit test keeps the two equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

HONOURED = "honoured"
NO_EFFECT = "no effect"
REFUSED = "refused"

COMPLETION = frozenset({"completion"})
CHAT = frozenset({"chat"})
BOTH = COMPLETION | CHAT
ENDPOINT = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _is_number(v: Any, x: float) -> bool:
    return (not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
            and v == x)


def _off_number(x: float) -> Callable[[Any], bool]:
    return lambda v: _is_number(v, x)


def _off_values(*values: Any) -> Callable[[Any], bool]:
    """Equal to one of ``values`` and of its type (``False`` is not ``0``, ``[]`` not ``{}``)."""
    return lambda v: any(type(v) is type(w) and v == w for w in values)


def _never(v: Any) -> bool:
    return False


@dataclass(frozen=True)
class Field:
    effect: str  # HONOURED | NO_EFFECT | REFUSED
    kinds: frozenset[str] = BOTH
    off: Callable[[Any], bool] = _never  # REFUSED: the values that ask for nothing (null aside)
    why: str = ""  # REFUSED: what is not supported, for the error message


def _refused(why: str, off: Callable[[Any], bool] = _never,
             kinds: frozenset[str] = BOTH) -> Field:
    return Field(REFUSED, kinds, off, why)


_H = Field(HONOURED)
_N = Field(NO_EFFECT)
_NOT_TOOLS = _off_values("none", "auto")

FIELDS: dict[str, Field] = {
    # What the request asks for (serve/openai/openai_request.py parses and checks these).
    "model": _H,
    "prompt": Field(HONOURED, COMPLETION),
    "messages": Field(HONOURED, CHAT),
    "max_tokens": _H,
    "max_completion_tokens": Field(HONOURED, CHAT),
    "temperature": _H,
    "top_p": _H,
    "top_k": _H,
    "seed": _H,
    "n": _H,  # at most 16 (openai_request.py); choice i > 0 seeds with sampling.choice_seed
    "best_of": Field(HONOURED, COMPLETION),  # only equal to n (nothing to choose among)
    "stop": _H,
    "stop_token_ids": _H,
    "ignore_eos": _H,
    "stream": _H,
    "stream_options": _H,
    "add_generation_prompt": Field(HONOURED, CHAT),
    "presence_penalty": _H,  # the sampling controls: engine/sampling.py
    "frequency_penalty": _H,
    "repetition_penalty": _H,
    "logit_bias": _H,
    "min_tokens": _H,
    "response_format": _H,  # structured output: serve/openai/structured_request.py
    "guided_json": _H,
    "guided_regex": _H,
    "guided_choice": _H,
    "guided_grammar": _H,
    "structured_outputs": _H,
    "tools": Field(HONOURED, CHAT),  # serve/openai/tool_request.py, serve/openai/tool_parser.py
    "tool_choice": Field(HONOURED, CHAT),
    "parallel_tool_calls": Field(HONOURED, CHAT),
    "logprobs": _H,  # raw log-probabilities: serve/openai/logprob_format.py
    "top_logprobs": Field(HONOURED, CHAT),
    "echo": _H,  # on chat false only (serve/openai/openai_request.py)
    "prompt_logprobs": _H,  # on chat null only
    "return_tokens_as_token_ids": _H,  # log-probabilities' tokens as "token_id:<id>"
    # Accepted and without effect on the answer.
    "user": _N,
    "metadata": _N,
    "service_tier": _N,
    "prompt_cache_key": _N,
    "safety_identifier": _N,
    "prediction": _N,  # a latency hint: the answer is the same
    "priority": _N,  # vLLM's scheduling priority: pdd schedules first come, first served
    "request_id": _N,  # the router names its requests itself
    "return_token_ids": _N,  # every choice carries token_ids anyway
    "guided_decoding_backend": _N,  # llguidance whatever is named (docs/openai-api.md)
    "spaces_between_special_tokens": _N,  # special tokens are never shown
    # Refused unless they ask for nothing.
    "use_beam_search": _refused("beam search is not supported", _off_values(False)),
    "length_penalty": _refused("length_penalty (beam search) is not supported",
                               _off_number(1)),
    "suffix": _refused("suffix (insertion) is not supported", _off_values(""), COMPLETION),
    "min_p": _refused("min_p is not supported", _off_number(0)),
    "allowed_token_ids": _refused("allowed_token_ids is not supported"),
    "bad_words": _refused("bad_words is not supported", _off_values([])),
    "logits_processors": _refused("custom logits processors are not supported",
                                  _off_values([])),
    "include_stop_str_in_output": _refused("stop strings are always cut from the text",
                                           _off_values(False)),
    "skip_special_tokens": _refused("special tokens are always left out of the text",
                                    _off_values(True)),
    "add_special_tokens": _refused(
        "a text prompt is always encoded with the tokenizer's special tokens", _off_values(True),
        COMPLETION),
    "truncate_prompt_tokens": _refused("prompt truncation is not supported"),
    "functions": _refused("the legacy functions field is not supported (send tools)",
                          _off_values([]), CHAT),
    "function_call": _refused("the legacy function_call field is not supported (send "
                              "tool_choice)", _NOT_TOOLS, CHAT),
    "continue_final_message": _refused("continuing the final message is not supported",
                                       _off_values(False), CHAT),
    "chat_template": _refused("the checkpoint's own chat template is always used", _never,
                              CHAT),
    "chat_template_kwargs": _refused("chat template arguments are not supported",
                                     _off_values({}), CHAT),
    "documents": _refused("documents for the chat template are not supported",
                          _off_values([]), CHAT),
    "reasoning_effort": _refused("reasoning_effort is not supported", _never, CHAT),
    "verbosity": _refused("verbosity is not supported", _never, CHAT),
    "modalities": _refused("only text output is supported", _off_values(["text"]), CHAT),
    "audio": _refused("audio output is not supported", _never, CHAT),
    "web_search_options": _refused("web search is not supported", _never, CHAT),
    "mm_processor_kwargs": _refused("multimodal input is not supported", _off_values({})),
    "prompt_embeds": _refused("prompt embeddings are not supported"),
    "cache_salt": _refused("the prefix cache is shared by every request (no per-tenant salt)"),
    "vllm_xargs": _refused("vLLM's extra arguments are not supported", _off_values({})),
    "store": _refused("nothing is stored (no stored completions to list or distil)",
                      _off_values(False)),
    "guided_whitespace_pattern": _refused(
        "JSON always comes out in llguidance's compact layout; a whitespace pattern is not "
        "supported"),
}


def _quoted(v: Any) -> str:
    """The value in the message when it is short; a long one is left out (it may be a schema)."""
    text = repr(v)
    return f" (got {text})" if len(text) <= 60 else ""


def refusal(kind: str, body: Mapping[str, Any],
            extra: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """``(field, message)`` for the first field of ``body`` that ``kind``'s endpoint does not
    honour and that asks for something, else None. ``extra``: fields the caller takes beside
    the table (the instances' vLLM protocol: what vLLM's proxies send), which pass here."""
    for name, value in body.items():
        if name in extra:
            continue
        field = FIELDS.get(name)
        if field is None or kind not in field.kinds:
            where = ENDPOINT[kind]
            shown = name if len(name) <= 60 else name[:60] + "..."
            if field is not None:
                return name, f"{shown}: not a field of {where}"
            return name, (f"{shown}: unrecognized request argument for {where} (the fields "
                          "pdd takes are listed in docs/openai-api.md)")
        if field.effect != REFUSED or value is None or field.off(value):
            continue
        return name, f"{name}: {field.why}{_quoted(value)}"
    return None


class FieldError(ValueError):
    """A 400 naming ``param``, the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:60] + "..."


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def include_usage(opts: Any) -> bool:
    """``stream_options``' ``include_usage``. Its keys are booleans; a key pdd does not know
    is refused, and so is vLLM's ``continuous_usage_stats: true`` (usage in every chunk),
    which pdd does not send: a client counting on it would read nulls."""
    if not isinstance(opts, dict):
        raise FieldError(f"stream_options must be an object, got {_short(opts)}",
                         "stream_options")
    for key, value in opts.items():
        shown = key if len(key) <= 60 else key[:60] + "..."
        if key not in STREAM_OPTIONS:
            raise FieldError(f"stream_options.{shown}: unrecognized (pdd takes "
                             "include_usage)", "stream_options")
        if value is not None and not isinstance(value, bool):
            raise FieldError(f"stream_options.{key} must be true or false, got "
                             f"{_short(value)}", "stream_options")
    if opts.get("continuous_usage_stats"):
        raise FieldError("stream_options.continuous_usage_stats: usage in every chunk is not "
                         "supported (got True); include_usage sends it once, after the last "
                         "choice", "stream_options")
    return opts.get("include_usage") is True


LIMITS = ("max_completion_tokens", "max_tokens")


def token_limit(body: Mapping[str, Any]) -> str | None:
    """The field that bounds the completion, or None when neither is given:
    ``max_completion_tokens`` (OpenAI's current name) or ``max_tokens`` (its deprecated one,
    and the completions endpoint's). Each given is checked to be an integer; both given and
    different is refused rather than one silently preferred."""
    given = [k for k in LIMITS if body.get(k) is not None]
    for key in given:
        v = body[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise FieldError(f"{key} must be an integer, got {_short(v)}", key)
    if len(given) == 2 and body[LIMITS[0]] != body[LIMITS[1]]:
        raise FieldError(f"max_completion_tokens ({body[LIMITS[0]]}) and max_tokens "
                         f"({body[LIMITS[1]]}) differ; send one of them (max_tokens is the "
                         "older name of the same limit)", "max_completion_tokens")
    return given[0] if given else None
