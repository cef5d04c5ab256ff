"""The router's reading of an OpenAI completion or chat request, and its errors in OpenAI's shape.

Bad input is refused here, before any replica works on it, with error JSON naming the field
(and so is a field that would change the answer and is not implemented, or is unknown: the
table of serve/openai/openai_fields.py); what passes is a `GenRequest` in the terms the prefill and
decode instances speak.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from pdd_sidecar.grammar import GrammarError, Spec, check
from pdd_sidecar.serve.openai.openai_fields import FieldError, include_usage, refusal, token_limit
from pdd_sidecar.serve.openai.structured_request import STRUCTURED, StructuredError, structured_spec
from pdd_sidecar.serve.openai.text import (
    ModelText,
    TemplateRenderError,
    chat_ids,
    template_variables,
)
from pdd_sidecar.serve.openai.tool_grammar import tool_call_grammar
from pdd_sidecar.serve.openai.tool_parser import Markers, template_call_format
from pdd_sidecar.serve.openai.tool_request import (
    ToolRequestError,
    ToolSpec,
    check_tool_turns,
    tool_spec,
)

INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20  # engine/sampling.py's bound (OpenAI's on top_logprobs)
MAX_CHOICES = 16  # n's bound (engine/sampling.py's, which the instances check)
MAX_PROMPTS = 64  # prompts in one completions request (each runs as its own request)
T = TypeVar("T")


class ApiError(Exception):
    """An answer in OpenAI's error format: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or self.TYPES.get(status) or (
            "invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


@dataclass
class GenRequest:
    """One validated completion request, in the terms the instances speak."""

    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    local_stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0  # stop strings are looked for only after this many tokens
    tools: ToolSpec | None = None  # chat: the tools offered (serve/openai/tool_request.py)
    logprobs: int | None = None  # top count of each generated token's log-probabilities
    echo: bool = False  # completions: the prompt's text (and log-probabilities) first
    prompt_logprobs: int | None = None  # top count of the prompt tokens' (echo or vLLM's)
    vllm_prompt_logprobs: bool = False  # the choice carries vLLM's prompt_logprobs list
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    prompt_text: str | None = None  # a completion's prompt as sent, when it was text
    n: int = 1  # choices: one prefill and one hand-off, n decode sequences


def brief_repr(v: Any, limit: int = 80) -> str:
    """A client's value in an error message, cut short (it may be megabytes)."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + "..."


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))  # ints: no float()


# A list of only these (a prompt of token ids) holds no string to check, and is skipped at C
# speed: the router checks every body on its event loop.
_SCALARS = {int, float, bool, type(None)}


def _check_strings(value: Any, path: str, top: str) -> None:
    """JSON may carry lone surrogates (`"\\ud800"`), which no tokenizer can encode.

    A loop, not recursion: a body nested as deep as the JSON parser allows must not reach
    Python's recursion limit here."""
    todo: list[tuple[Any, str]] = [(value, path)]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                where = path if len(path) <= 80 else path[:80] + "..."
                raise bad(f"{where}: contains an unpaired surrogate, not valid Unicode text",
                          top) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, path))
                todo.append((v, f"{path}.{k}"))
        elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:
            todo.extend((v, f"{path}[{i}]") for i, v in enumerate(value))


def _field(read: Callable[[Any], T], value: Any) -> T:
    """``read(value)``, its FieldError as the 400."""
    try:
        return read(value)
    except FieldError as exc:
        raise bad(str(exc), exc.param) from None


def _opt_int(body: Mapping[str, Any], key: str, default: int | None, lo: int | None = None,
             hi: int | None = None, what: str = "") -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise bad(f"{key} must be an integer{what}, got {brief_repr(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(f"{key} must be an integer{what}, got {v}", key)
    return int(v)


def _opt_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key} must be true or false, got {brief_repr(v)}", key)
    return v


def _opt_number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
                lo_open: bool, what: str) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v) or (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(f"{key} must be a number in {what}, got {brief_repr(v)}", key)
    return float(v)


def _logit_bias(body: Mapping[str, Any], model: ModelText) -> dict[str, float]:
    """OpenAI's ``{"token id": bias}``; zero biases are dropped (they ask for nothing)."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad(f"logit_bias must be an object mapping token ids to biases, got "
                  f"{brief_repr(raw)}", "logit_bias")
    out = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20
                and int(key) < model.vocab_size):
            raise bad(f"logit_bias: keys must be token ids in [0, {model.vocab_size}) (the "
                      f"model's vocabulary), got {brief_repr(key)}", "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise bad(f"logit_bias: biases must be numbers in [-100, 100], got "
                      f"{brief_repr(value)} for token {key}", "logit_bias")
        out[str(int(key))] = float(value)
    return {k: v for k, v in out.items() if v}


def _controls(body: Mapping[str, Any], model: ModelText) -> dict[str, Any]:
    """The sampling controls that ask for something (engine/sampling.py applies them); a
    request without any sends the instances what it sent before they existed."""
    out: dict[str, Any] = {}
    for key in ("presence_penalty", "frequency_penalty"):
        v = _opt_number(body, key, 0.0, -2.0, 2.0, False, "[-2, 2]")
        if v:
            out[key] = v
    rep = _opt_number(body, "repetition_penalty", 1.0, 1e-6, 1e6, False,
                      "[1e-6, 1e6] (> 0; the bounds keep the logits finite)")
    if rep != 1.0:
        out["repetition_penalty"] = rep
    bias = _logit_bias(body, model)
    if bias:
        out["logit_bias"] = bias
    return out


def _ids(value: Any, model: ModelText, param: str) -> list[int] | None:
    """A list of token ids, validated against the vocabulary; None if it is not a list of ints."""
    if not isinstance(value, list):
        return None
    if value and set(map(type, value)) == {int}:  # the usual case, at C speed
        if 0 <= min(value) and max(value) < model.vocab_size:
            return list(value)
    elif not all(is_int(t) for t in value):
        return None
    bad_ids = [t for t in value if not 0 <= t < model.vocab_size]
    if bad_ids:
        raise bad(f"{param}: token ids must be in [0, {model.vocab_size}) (the model's "
                  f"vocabulary), got {bad_ids[:5]}", param)
    return list(value)


def _need_codec(model: ModelText, param: str) -> Any:
    if model.codec is None:
        raise bad(f"{param}: the model at {model.source} has no tokenizer "
                  f"({model.missing_tokenizer}); send the prompt as token ids", param)
    return model.codec


def _prompt_texts(body: Mapping[str, Any], n: int) -> list[str | None]:
    """Each prompt as sent, when it was text (an echo shows it as sent)."""
    prompt = body.get("prompt")
    items = prompt if isinstance(prompt, list) and len(prompt) == n and all(
        isinstance(p, (str, list)) for p in prompt) else [prompt]
    return [p if isinstance(p, str) else None for p in items]


def _logprob_fields(kind: str, body: Mapping[str, Any]) -> tuple[int | None, bool, int | None]:
    """``(logprobs top count, echo, prompt_logprobs top count)`` as each endpoint spells them
    (completions: ``logprobs: k``; chat: ``logprobs: true`` with ``top_logprobs: k``)."""
    what = f" in [0, {MAX_LOGPROBS}]"
    echo = _opt_bool(body, "echo", False)
    if kind == "chat":
        if echo:
            raise bad("echo: echoing the prompt is supported on /v1/completions only",
                      "echo")
        if body.get("prompt_logprobs") is not None:
            raise bad("prompt_logprobs: supported on /v1/completions only", "prompt_logprobs")
        wanted = _opt_bool(body, "logprobs", False)
        top = _opt_int(body, "top_logprobs", None, 0, MAX_LOGPROBS, what)
        if top and not wanted:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None, False, None
    raw = body.get("logprobs")
    logprobs = None if raw is False else _opt_int(body, "logprobs", None, 0, MAX_LOGPROBS, what)
    prompt = _opt_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS, what)
    return logprobs, echo, prompt


def _prompts(body: Mapping[str, Any], model: ModelText) -> list[list[int]]:
    """The prompt, or each of OpenAI's list form (strings, or lists of token ids); an element
    that is neither is refused naming ``prompt[i]``."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad(f"prompt: at most {MAX_PROMPTS} prompts in one request, got "
                      f"{len(prompt)}", "prompt")
        if len(prompt) == 1:
            return [_prompt_ids(prompt[0], model, "prompt")]
        return [_prompt_ids(p, model, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt_ids(prompt, model, "prompt")]


def _prompt_ids(prompt: Any, model: ModelText, where: str) -> list[int]:
    if isinstance(prompt, str):
        codec = _need_codec(model, "prompt")
        ids = list(codec.encode(prompt, add_special_tokens=True))
    else:
        ids_or_none = _ids(prompt, model, where)
        if ids_or_none is None:
            raise bad(f"{where} must be a string, a list of token ids, or a list of those",
                      where)
        ids = ids_or_none
    if not ids:
        raise bad(f"{where} is empty (no tokens)", where)
    return ids


def _content_text(content: Any, where: str) -> str | None:
    """Message content: a string, or OpenAI content parts of type text (joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if (not isinstance(part, dict) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise bad(f"{where}[{i}]: only text content parts "
                          '({"type": "text", "text": ...}) are supported', "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", "messages")


def _tools(body: Mapping[str, Any], model: ModelText) -> ToolSpec | None:
    """The request's tools, refused where this checkpoint cannot take them: a template that
    does not render them would drop them silently, and a tokenizer without DeepSeek's
    tool-call tokens gives the router nothing to find a call by."""
    try:
        spec = tool_spec(body)
    except ToolRequestError as exc:
        raise bad(str(exc), exc.param) from None
    if spec is None or not spec.parse:
        return spec
    codec = _need_codec(model, "tools")
    if codec.chat_template is None or "tools" not in template_variables(codec.chat_template):
        raise bad(f"tools: the chat template of {model.source} does not render tool "
                  "definitions (it reads no `tools` variable), so the model would never see "
                  "them; put a template that does in the checkpoint's chat_template.jinja "
                  "(docs/openai-api.md, Tool calling)", "tools")
    if Markers.of(codec) is None:
        raise bad(f"tools: the tokenizer of {model.source} lacks DeepSeek's tool-call tokens "
                  "(<｜tool▁calls▁begin｜> ...), the only tool-call format this server parses",
                  "tools")
    if template_call_format(codec.chat_template) == "v3.1":
        raise bad(f"tools: the chat template of {model.source} writes tool calls in "
                  "DeepSeek-V3.1's format (NAME<｜tool▁sep｜>ARGUMENTS, no type or fence), which "
                  "this server does not parse: the calls would come back as text. Use a "
                  "template that writes V2.5/V3's (docs/openai-api.md, Tool calling)", "tools")
    return spec


def _forced_calls(spec: ToolSpec, model: ModelText) -> dict[str, Any]:
    """tool_choice required / named: the structured-output spec of a grammar that lets the
    model write nothing but the calls; auto with a strict tool: text, then calls or nothing
    (a tool's schema llguidance cannot compile is a 400)."""
    markers = Markers.of(model.codec)
    assert markers is not None  # _tools checked
    grammar = Spec("lark", tool_call_grammar(spec.tools, markers, spec.named, spec.parallel,
                                             optional=not spec.forced))
    try:
        check(grammar)
    except GrammarError as exc:
        what = "tool_choice" if spec.forced else "strict"
        raise bad(f"tools: the parameters cannot be enforced for {what}: {exc}",
                  "tools") from None
    return grammar.to_json()


def _chat_prompt(body: Mapping[str, Any], model: ModelText,
                 tools: ToolSpec | None = None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    conv = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role must be a non-empty string", "messages")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), f"messages[{i}].content")
        try:
            check_tool_turns(i, msg)
        except ToolRequestError as exc:
            raise bad(str(exc), exc.param) from None
        conv.append(msg)
    add_gen = _opt_bool(body, "add_generation_prompt", True)
    codec = _need_codec(model, "messages")
    try:
        ids = chat_ids(codec, conv, add_generation_prompt=add_gen,
                       tools=list(tools.tools) if tools is not None and tools.tools else None)
    except TemplateRenderError as exc:
        raise bad(f"messages: {exc}", "messages") from None
    if not ids:
        raise bad("messages render to no tokens", "messages")
    return ids


def parse_request(kind: str, body: Any, model: ModelText, served: str,
                  served_len: int | None = None) -> GenRequest:
    """``served_len``: the length the instances can hold (the router's /v1/models
    ``max_model_len``), the default completion of a chat that sets none runs up to. A
    completions request of several prompts is refused here: ``parse_requests`` reads it."""
    reqs = parse_requests(kind, body, model, served, served_len)
    if len(reqs) > 1:
        raise bad(f"prompt: {len(reqs)} prompts where one is expected", "prompt")
    return reqs[0]


def parse_requests(kind: str, body: Any, model: ModelText, served: str,
                   served_len: int | None = None) -> list[GenRequest]:
    """One request per prompt (a completions request's list form), each as ``parse_request``
    reads it: the same fields (seed included) for every prompt."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", None)
    refused = refusal(kind, body)
    if refused is not None:
        raise bad(refused[1], refused[0])
    for key, value in body.items():
        _check_strings(value, key, key)
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad(f"model must be a string, got {brief_repr(name)}", "model")
    if name not in (None, "", served):
        raise ApiError(404, f"the model {brief_repr(name)} does not exist; this server serves "
                       f"{served!r}", "model", "not_found_error", "model_not_found")
    stream = _opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    usage = False
    if opts is not None:
        usage = _field(include_usage, opts)
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
    temperature = _opt_number(body, "temperature", 1.0, 0.0, 2.0, False, "[0, 2]")
    top_p = _opt_number(body, "top_p", 1.0, 0.0, 1.0, True, "(0, 1]")
    top_k = _opt_int(body, "top_k", 0, -1, None, " (-1 or 0 = off, else >= 1)")
    controls = _controls(body, model)
    seed = _opt_int(body, "seed", None, INT64[0], INT64[1], " in the signed 64-bit range")
    if seed is None:
        seed = secrets.randbits(63)
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif (isinstance(stop_raw, list) and len(stop_raw) <= MAX_STOP_STRINGS
          and all(isinstance(s, str) for s in stop_raw)):
        stop = list(stop_raw)
    else:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings, "
                  f"got {brief_repr(stop_raw)}", "stop")
    stop = [s for s in stop if s]
    if stop:
        _need_codec(model, "stop")
    stop_ids_raw = body.get("stop_token_ids")
    if stop_ids_raw is None:
        stop_token_ids: list[int] = []
    else:
        checked = _ids(stop_ids_raw, model, "stop_token_ids")
        if checked is None:
            raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        stop_token_ids = checked
    ignore_eos = _opt_bool(body, "ignore_eos", False)
    logprobs, echo, vllm_prompt = _logprob_fields(kind, body)
    tokens_as_ids = _opt_bool(body, "return_tokens_as_token_ids", False)
    n = _opt_int(body, "n", 1, 1, MAX_CHOICES, f" in [1, {MAX_CHOICES}]")
    assert n is not None
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad(f"best_of: only best_of equal to n ({n}) is supported, got "
                  f"{brief_repr(best_of)}", "best_of")

    tools: ToolSpec | None = None
    texts: list[str | None] = [None]
    if kind == "completion":
        prompts = _prompts(body, model)
        texts = _prompt_texts(body, len(prompts))
        prompt_param = "prompt"
    else:
        tools = _tools(body, model)
        prompts = [_chat_prompt(body, model, tools)]
        prompt_param = "messages"
    limit = model.max_model_len
    for i, prompt in enumerate(prompts):
        where = f"{prompt_param}[{i}]" if len(prompts) > 1 else prompt_param
        if len(prompt) >= limit:
            raise bad(f"{where}: the prompt is {len(prompt)} tokens; this model's maximum "
                      f"context length is {limit} tokens (prompt + completion)", prompt_param)
    key = _field(token_limit, body) or "max_tokens"
    default = 16 if kind == "completion" else max(1, min(limit, served_len or limit)
                                                  - len(prompts[0]))
    # With echo a completion may ask for the prompt alone (its log-probabilities).
    least = 0 if echo else 1
    max_tokens = _opt_int(body, key, default, least, None, f" >= {least}")
    assert max_tokens is not None
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_tokens > limit:
            which = f" (prompt[{i}])" if len(prompts) > 1 else ""
            raise bad(f"{key}: this model's maximum context length is {limit} tokens; the "
                      f"request{which} asks for {len(prompt) + max_tokens} ({len(prompt)} in "
                      f"the prompt, {max_tokens} for the completion)", key)
    min_tokens = _opt_int(body, "min_tokens", 0, 0, None, " >= 0")
    assert min_tokens is not None
    if min_tokens > max_tokens:
        raise bad(f"min_tokens must be at most {key} ({max_tokens}), got {min_tokens}",
                  "min_tokens")
    if min_tokens:
        controls["min_tokens"] = min_tokens
    try:
        structured = structured_spec(body)
    except StructuredError as exc:
        raise bad(str(exc), exc.param) from None
    if structured is not None:
        controls[STRUCTURED] = structured.to_json()
    if tools is not None and tools.forced:
        if structured is not None:
            raise bad("tool_choice: a required or named tool call cannot be combined with "
                      "structured output (the answer is the calls)", "tool_choice")
        controls[STRUCTURED] = _forced_calls(tools, model)
    elif tools is not None and tools.strict:
        if structured is not None:
            raise bad("tools: a strict tool's arguments cannot be enforced beside structured "
                      "output (two grammars on one answer); send strict: false or no "
                      "response_format", "tools")
        controls[STRUCTURED] = _forced_calls(tools, model)
    local = set(stop_token_ids)
    if not ignore_eos:
        local |= model.eos_token_ids
    first = GenRequest(
        kind=kind, prompt_ids=prompts[0], max_tokens=max_tokens,
        sampling={"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                  **controls},
        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, stream=stream,
        include_usage=usage, local_stop_ids=frozenset(local), min_tokens=min_tokens,
        tools=tools, n=n,
        logprobs=logprobs, echo=echo, prompt_logprobs=_prompt_count(echo, logprobs, vllm_prompt),
        vllm_prompt_logprobs=vllm_prompt is not None, tokens_as_ids=tokens_as_ids,
        prompt_text=texts[0] if kind == "completion" else None)
    return [first, *(dataclasses.replace(first, prompt_ids=p, prompt_text=t)
                     for p, t in zip(prompts[1:], texts[1:], strict=True))]


def _prompt_count(echo: bool, logprobs: int | None, vllm_prompt: int | None) -> int | None:
    """The top count the prefill computes for the prompt's tokens: what echo with logprobs
    shows, or vLLM's prompt_logprobs, whichever is larger; None when neither asks."""
    counts = [k for k in (logprobs if echo else None, vllm_prompt) if k is not None]
    return max(counts) if counts else None
