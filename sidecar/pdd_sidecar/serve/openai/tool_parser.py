"""The DeepSeek-V2.5/V3 tool-call block in a completion, parsed as its tokens arrive.

The model writes

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The markers are special tokens, which the text shown to clients leaves out, so the block is
found by token id, and only the text between markers is decoded. One state machine serves the
streamed and the whole answer: the whole answer is what its deltas add up to, so the two cannot
disagree. A call is announced (id, name) once its header is complete; its arguments stream as
they are decoded, less a tail of blanks and backticks that may be the closing fence. A block
that breaks the format becomes content again, shown with its markers: it is what the model
wrote, and no call is made up from it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Protocol

from pdd_sidecar.serve.openai.text import IncrementalDetokenizer, TemplateRenderError, render_chat

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"

# NAME, then the opening fence; what follows it is the arguments.
_HEADER = re.compile(r"([A-Za-z0-9_.-]{1,64})[ \t]*\n```(?:json)?[ \t]*\n")
_FENCE_OPENING = re.compile(r"j(s(on?)?)?|(json)?[ \t]*")  # what may follow ``` before its \n
_HEADER_LIMIT = 160  # characters after the separator without a complete header: not a call
_TYPE_LIMIT = 8  # tokens between call begin and separator
_FENCE_TAIL = " \t\r\n`"


class MarkerCodec(Protocol):
    name: str
    chat_template: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def token_id(self, content: str) -> int | None: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def decode_raw(self, token_ids: list[int]) -> str: ...


class _Raw:
    """A codec whose decode keeps the special tokens, for IncrementalDetokenizer."""

    def __init__(self, codec: MarkerCodec) -> None:
        self.codec = codec
        self.name, self.chat_template = codec.name, codec.chat_template
        self.special_tokens = codec.special_tokens

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.codec.encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.codec.decode_raw(token_ids)

    def decode_raw(self, token_ids: list[int]) -> str:
        return self.codec.decode_raw(token_ids)

    def token_id(self, content: str) -> int | None:
        return self.codec.token_id(content)


@dataclass(frozen=True)
class Markers:
    calls_begin: int
    call_begin: int
    sep: int
    call_end: int
    calls_end: int

    @classmethod
    def of(cls, codec: Any) -> Markers | None:
        """The markers' token ids, or None when the tokenizer lacks any of them."""
        lookup = getattr(codec, "token_id", None)
        if lookup is None:
            return None
        ids = [lookup(t) for t in (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)]
        if any(i is None for i in ids):
            return None
        return cls(*ids)

    def all(self) -> frozenset[int]:
        return frozenset((self.calls_begin, self.call_begin, self.sep, self.call_end,
                          self.calls_end))


_PROBE_NAME = "probe_fn"
_PROBE = ({"role": "user", "content": "q"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_0", "type": "function",
               "function": {"name": _PROBE_NAME, "arguments": '{"a": 1}'}}]},
          {"role": "tool", "tool_call_id": "call_0", "content": "r"})


@lru_cache(maxsize=16)
def template_call_format(chat_template: str) -> Literal["v3", "v3.1"] | None:
    """How a chat template writes an assistant's tool call, which is how the model was taught
    to write one: "v3" (type, separator, name, fenced JSON: what ToolCallParser reads), "v3.1"
    (name, separator, bare arguments), or None when a probe conversation shows neither."""
    try:
        text = render_chat(chat_template, _PROBE, {}, add_generation_prompt=False)
    except TemplateRenderError:
        return None
    if f"function{SEP}{_PROBE_NAME}\n```json" in text:
        return "v3"
    if f"{CALL_BEGIN}{_PROBE_NAME}{SEP}" in text:
        return "v3.1"
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Feed it the completion's tokens from a `<｜tool▁calls▁begin｜>` on (`active` says when
    it wants them); each `feed` returns (content text, tool-call deltas in OpenAI's stream
    shape)."""

    def __init__(self, codec: MarkerCodec, markers: Markers, single: bool = False) -> None:
        self.codec = codec
        self.m = markers
        self.single = single  # parallel_tool_calls: false: the first call ends the answer
        self.active = False
        self.done = False  # single, and the first call has ended
        self.state = "idle"
        self.calls: list[dict[str, Any]] = []  # OpenAI's message.tool_calls, built up
        self.raw_ids: list[int] = []  # since the block's last call that is sure
        self.seg: list[int] = []  # the current part's tokens (type, or name + arguments)
        # Arguments and the content after a break are decoded a token at a time (a long
        # argument decoded whole at each token would cost its length squared).
        self.args_text = ""
        self.args_detok: IncrementalDetokenizer | None = None
        self.shown_args = ""
        self.raw_detok: IncrementalDetokenizer | None = None

    # ------------------------------------------------------------ states
    def feed(self, token: int) -> tuple[str, list[dict[str, Any]]]:
        if self.state == "raw":
            return self._raw(token), []
        self.raw_ids.append(token)
        if self.state == "idle":
            if token != self.m.calls_begin:
                raise ValueError("the tool-call parser starts at the calls-begin token")
            self.active = True
            self.state = "calls"
            return "", []
        if self.state == "calls":
            if token == self.m.call_begin:
                self.state, self.seg = "type", []
                return "", []
            if token == self.m.calls_end:
                self.active, self.state = False, "idle"
                self.raw_ids = []
                return "", []
            if token not in self.m.all() and not self.codec.decode([token]).strip():
                return "", []  # a newline between calls
            return self._broken(), []
        if self.state == "type":
            if token == self.m.sep:
                if self.codec.decode(self.seg).strip() != "function":
                    return self._broken(), []
                self.state, self.seg = "name", []
                return "", []
            if token in self.m.all() or len(self.seg) >= _TYPE_LIMIT:
                return self._broken(), []
            self.seg.append(token)
            return "", []
        if self.state == "name":
            if token in self.m.all():
                return self._broken(), []
            self.seg.append(token)
            text = self.codec.decode(self.seg)
            match = _HEADER.match(text)
            if match is None:
                fence = text.find("```")
                if len(text) > _HEADER_LIMIT or (
                        fence >= 0 and not _FENCE_OPENING.fullmatch(text[fence + 3:])):
                    return self._broken(), []
                return "", []
            self.calls.append({"id": call_id(), "type": "function",
                               "function": {"name": match.group(1), "arguments": ""}})
            self.state, self.args_text, self.shown_args = "args", text[match.end():], ""
            self.args_detok = IncrementalDetokenizer(self.codec, self.seg)
            self.raw_ids = []
            head = {"index": len(self.calls) - 1, "id": self.calls[-1]["id"],
                    "type": "function", "function": {"name": match.group(1), "arguments": ""}}
            return "", [head, *self._args(final=False)]
        # args
        if token == self.m.call_end:
            deltas = self._args(final=True)
            self.state, self.seg, self.raw_ids = "calls", [], []
            if self.single:
                self.done, self.active = True, False
            return "", deltas
        if token in self.m.all():
            self.raw_ids = [token]  # the arguments so far stay the call's
            return self._broken(), []
        assert self.args_detok is not None
        self.args_text += self.args_detok.add(token)
        return "", self._args(final=False)

    def _args(self, final: bool) -> list[dict[str, Any]]:
        if final and self.args_detok is not None:
            self.args_text += self.args_detok.flush()
        shown = self.args_text.rstrip(_FENCE_TAIL)
        if len(shown) <= len(self.shown_args) or not shown.startswith(self.shown_args):
            return []
        delta = shown[len(self.shown_args):]
        self.shown_args = shown
        self.calls[-1]["function"]["arguments"] = shown
        return [{"index": len(self.calls) - 1, "function": {"arguments": delta}}]

    def _broken(self) -> str:
        """The block is not in the format: what it holds since the last sure call is content,
        and so is the rest of the completion."""
        self.state = "raw"
        self.active = True
        self.raw_detok = IncrementalDetokenizer(_Raw(self.codec), self.raw_ids)
        return self.codec.decode_raw(self.raw_ids)

    def _raw(self, token: int) -> str:
        assert self.raw_detok is not None
        return self.raw_detok.add(token)

    def end(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The completion ended inside the block: on a stop token, or ``cut`` by the length
        limit, which leaves a call's header unfinished without the model having broken the
        format (nothing of it was announced; it is dropped)."""
        if self.state == "raw":
            assert self.raw_detok is not None
            return self.raw_detok.flush(), []
        if self.state in ("type", "name"):
            if cut:
                self.state = "calls"
                return "", []
            return self._broken(), []
        if self.state == "args":
            return "", self._args(final=True)
        return "", []
