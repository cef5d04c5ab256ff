"""A streamed completion's server-sent events, in OpenAI's chunk formats.

Every decode step sends each stream one event, and with a few hundred streams that is the
router's commonest work. The fields that never change within a stream are encoded once, and an
event that does not end the stream is written from a template instead of a dict and an encoder
call (8 µs against 1 µs a token): ``ChunkFormat.chunk`` is the reference, and every event
``ChunkFormat.step`` writes is byte for byte what json.dumps writes of that chunk.
"""

from __future__ import annotations

import json
from typing import Any


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n".encode()


class ChunkFormat:
    def __init__(self, rid: str, kind: str, created: int, model: str,
                 include_usage: bool) -> None:
        self.rid = rid
        self.kind = kind
        self.obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        self.created = created
        self.model = model
        self.include_usage = include_usage
        head = {"id": rid, "object": self.obj, "created": created, "model": model}
        self._head = json.dumps(head)[:-1]  # without its closing brace
        self._usage = ', "usage": null' if include_usage else ""

    def chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        body = {"id": self.rid, "object": self.obj, "created": self.created,
                "model": self.model, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The chunk after the last choice, with the request's usage (include_usage)."""
        return {"id": self.rid, "object": self.obj, "created": self.created,
                "model": self.model, "choices": [], "usage": usage}

    def role(self, index: int = 0) -> bytes:
        """A chat stream's first event (of each choice): the assistant's role, no content
        yet."""
        return sse(self.chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                               "token_ids": [], "logprobs": None, "finish_reason": None}))

    def step(self, tokens: list[int], text: str, finish: str | None,
             extra: dict[str, Any] | None = None,
             logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
        """One step's event of choice ``index``: its tokens, the text they completed, and
        (asked for) their log-probabilities in the endpoint's shape (logprob_format.py)."""
        if finish is None and not extra and logprobs is None:
            ids = "[" + ", ".join(str(t) for t in tokens) + "]"
            shown = json.dumps(text)
            content = (f'"text": {shown}' if self.kind == "completion"
                       else f'"delta": {{"content": {shown}}}')
            return (f'data: {self._head}, "choices": [{{"index": {index}, {content}, '
                    f'"token_ids": {ids}, "logprobs": null, "finish_reason": null}}]'
                    f'{self._usage}}}\n\n').encode()
        return sse(self.chunk(self.choice(tokens, text, finish, logprobs, index),
                              **(extra or {})))

    def tool_step(self, tokens: list[int], text: str, calls: list[dict[str, Any]],
                  finish: str | None, extra: dict[str, Any] | None = None,
                  logprobs: dict[str, Any] | None = None, index: int = 0) -> bytes:
        """A chat step that carries tool-call deltas (OpenAI's `delta.tool_calls`, each with
        its `index`; the first of a call names it, the rest add to its arguments)."""
        choice = self.choice(tokens, text, finish, logprobs, index)
        choice["delta"] = {**({"content": text} if text else {}), "tool_calls": calls}
        return sse(self.chunk(choice, **(extra or {})))

    def choice(self, tokens: list[int], text: str, finish: str | None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": index, "text": text}
        else:
            choice = {"index": index, "delta": {"content": text} if text or not finish else {}}
        choice.update(token_ids=tokens, logprobs=logprobs, finish_reason=finish)
        return choice
