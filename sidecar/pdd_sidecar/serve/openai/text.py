"""Text side of the router: the checkpoint's tokenizer, its chat template, detokenizing, stops.

A Hugging Face checkpoint brings `tokenizer.json` (loaded with the `tokenizers` package) and a
chat template in `tokenizer_config.json` or `chat_template.jinja`. The template is rendered the
way transformers' `apply_chat_template` renders it (same sandbox, extensions, globals and
variables), and the rendered text is encoded without adding special tokens again, so a request
gets the token ids the model was trained on without the router importing transformers. The
built-in model keeps its byte-level tokenizer. Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import jinja2.utils

from pdd_sidecar.model.config import BUILTIN, builtin_config
from pdd_sidecar.serve.openai import tokenizer as byte_tokenizer


class TextConfigError(ValueError):
    """The checkpoint directory cannot describe the served model; the message names the file."""


class TemplateRenderError(ValueError):
    """The chat template refused the conversation (its `raise_exception`, or a template error)."""


# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the names a template sees.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

# A minimal template for the built-in byte-level model, which has no checkpoint files; it uses no
# special tokens because the byte vocabulary has none.
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + '\n\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


class Codec(Protocol):
    """What the router needs from a tokenizer."""

    name: str
    chat_template: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def decode_raw(self, token_ids: list[int]) -> str: ...

    def token_id(self, content: str) -> int | None: ...


class ByteCodec:
    """The built-in model's tokenizer: token id = UTF-8 byte."""

    name = "byte-level (built-in model)"
    chat_template: str | None = BUILTIN_CHAT_TEMPLATE
    special_tokens: dict[str, str] = {}

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return byte_tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return byte_tokenizer.decode(token_ids)

    def decode_raw(self, token_ids: list[int]) -> str:
        return byte_tokenizer.decode(token_ids)

    def token_id(self, content: str) -> int | None:
        return None


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TextConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise TextConfigError(f"{path}: must hold a JSON object")
    return data


def _pick_template(value: Any, source: Path) -> str | None:
    """`chat_template` is a string, or (older layout) a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise TextConfigError(f"{source}: chat_template has several templates and no 'default'")
    raise TextConfigError(f"{source}: chat_template must be a string or a list of templates")


class HFCodec:
    """A checkpoint's `tokenizer.json` plus what tokenizer_config.json adds to it.

    Like transformers' fast tokenizer it adds the named special tokens of the config that
    tokenizer.json lacks as special added tokens, and keeps tokenizer.json's post-processor
    (transformers drops add_bos_token/add_eos_token when tokenizer.json is there).
    """

    def __init__(self, directory: Path) -> None:
        from tokenizers import AddedToken, Tokenizer

        self.name = str(directory / "tokenizer.json")
        try:
            self.tokenizer = Tokenizer.from_file(self.name)
        except Exception as exc:  # tokenizers raises a plain Exception on bad files
            raise TextConfigError(f"{self.name}: cannot load: {exc}") from None
        cfg_path = directory / "tokenizer_config.json"
        config = _read_json(cfg_path) if cfg_path.is_file() else {}
        raw: dict[str, Any] = {k: config[k] for k in SPECIAL_TOKEN_NAMES if config.get(k)}
        map_path = directory / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and map_path.is_file():
            for key, value in _read_json(map_path).items():
                if key in SPECIAL_TOKEN_NAMES and value and key not in raw:
                    raw[key] = value
        self.special_tokens: dict[str, str] = {}
        for key, value in raw.items():
            content = _token_content(value)
            if content is not None:
                self.special_tokens[key] = content
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        missing = []
        for key, content in self.special_tokens.items():
            if content not in added:
                value = raw[key]
                flags = {f: bool(value[f]) for f in ("single_word", "lstrip", "rstrip",
                                                       "normalized")
                         if isinstance(value, dict) and f in value}
                missing.append(AddedToken(content, special=True, **flags))
                added.add(content)
        if missing:
            self.tokenizer.add_special_tokens(missing)
        template = _pick_template(config.get("chat_template"), cfg_path)
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        self.chat_template: str | None = template

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode_raw(self, token_ids: list[int]) -> str:
        """With the special tokens: what the model wrote, markers and all."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def token_id(self, content: str) -> int | None:
        """The id of a token of the vocabulary (added tokens included) spelled ``content``."""
        found = self.tokenizer.token_to_id(content)
        return None if found is None else int(found)


@dataclass(frozen=True)
class ModelText:
    """What the router knows about the served model without loading it."""

    source: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    codec: Codec | None  # None: the checkpoint has no tokenizer.json (token ids only)
    missing_tokenizer: str = ""


def _eos_ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def load_model_text(source: str, max_model_len: int | None = None) -> ModelText:
    """The built-in model, or a Hugging Face directory's config.json and tokenizer files."""
    if not source or source == BUILTIN:
        cfg = builtin_config()
        return ModelText(BUILTIN, cfg.vocab_size, max_model_len or cfg.max_position_embeddings,
                         frozenset(), ByteCodec())
    directory = Path(source)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise TextConfigError(f"{config_path}: not found (model source must be a Hugging Face "
                              "checkpoint directory or 'builtin')")
    config = _read_json(config_path)
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise TextConfigError(f"{config_path}: vocab_size must be a positive integer, "
                              f"got {vocab!r}")
    max_pos = config.get("max_position_embeddings", 4096)
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise TextConfigError(f"{config_path}: max_position_embeddings must be a positive "
                              f"integer, got {max_pos!r}")
    eos = _eos_ids(config.get("eos_token_id"))
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        eos |= _eos_ids(_read_json(gen_path).get("eos_token_id"))
    codec: Codec | None = None
    missing = ""
    if (directory / "tokenizer.json").is_file():
        codec = HFCodec(directory)
    else:
        missing = f"{directory / 'tokenizer.json'} not found"
    return ModelText(str(directory), vocab, max_model_len or max_pos, frozenset(eos), codec,
                     missing)


# ---------------------------------------------------------------- chat template
class _TemplateDict:
    """`dict` inside a template, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` that refuses underscore attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks spans)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


@lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller (`tools`, `documents`, ...)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.exceptions.TemplateError:
        return frozenset()


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None values (templates print them as "None") and alias reasoning fields, as
    transformers does before rendering.

    One exception: an assistant turn of tool calls keeps `content: None`, as OpenAI's clients
    send it. DeepSeek's templates test `message['content'] is none` to render such a turn;
    without the key they take it for a text turn and fail (transformers 5 drops it, and fails
    so)."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items()
             if v is not None or (k == "content" and message.get("tool_calls"))}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(template: str, messages: Iterable[Mapping[str, Any]],
                special_tokens: Mapping[str, str], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    try:
        compiled = compile_template(template)
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateRenderError(f"chat template does not compile: {exc}") from None
    variables = {**special_tokens, **kwargs}
    try:
        return str(compiled.render(messages=_normalize_messages(messages), tools=tools,
                                   documents=None, add_generation_prompt=add_generation_prompt,
                                   **variables))
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateRenderError(f"chat template: {exc}") from None
    except Exception as exc:  # the template is code from the checkpoint; any failure is
        # about this conversation as far as the client can tell
        raise TemplateRenderError(f"chat template cannot render these messages: "
                                  f"{type(exc).__name__}: {exc}") from None


def chat_ids(codec: Codec, messages: Iterable[Mapping[str, Any]],
             add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a conversation: rendered text encoded without special tokens added again
    (the template wrote them)."""
    if codec.chat_template is None:
        raise TemplateRenderError(f"{codec.name} comes with no chat template")
    text = render_chat(codec.chat_template, messages, codec.special_tokens,
                       add_generation_prompt=add_generation_prompt, tools=tools)
    return codec.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- detokenizing and stops
class IncrementalDetokenizer:
    """Text of a growing token list, one delta per token, decoding only a short window.

    The window starts a few prompt tokens back, so tokenizers whose decoders depend on context
    (a leading space) decode the first tokens as they read in the full text. A delta that ends
    in U+FFFD waits for the next token: a multi-byte character may be split across tokens.
    """

    CONTEXT = 5

    def __init__(self, codec: Codec, prompt_ids: list[int]) -> None:
        self.codec = codec
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.codec.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.codec.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """What the last tokens hold back (an incomplete character, as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self.codec.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.codec.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""


class StopStrings:
    """Finds stop strings across deltas; holds back a tail that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string ended the text)."""
        if not self.stops:
            return delta, False
        buf = self.held + delta
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            self.hit = True
            return buf[:min(hits)], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
