"""The completion as the client sees it, built token by token from what the decode streams.

Text, stop strings and the finish reason are decided on the router's side: a stop string may
span tokens, and only the detokenized text shows where it begins. A chat offering tools has its
tool-call block taken out of the text by tool_parser.py: stop strings apply to the content
only (a call's arguments are never cut), and an answer that made calls finishes with
"tool_calls" where it would have finished with "stop".
"""

from __future__ import annotations

from typing import Any

from pdd_sidecar.serve.openai.openai_request import GenRequest
from pdd_sidecar.serve.openai.text import IncrementalDetokenizer, ModelText, StopStrings
from pdd_sidecar.serve.openai.tool_parser import Markers, ToolCallParser


class Output:
    """The completion as the client sees it: token ids, text, why it finished."""

    def __init__(self, req: GenRequest, model: ModelText) -> None:
        self.req = req
        self.detok = (IncrementalDetokenizer(model.codec, req.prompt_ids)
                      if model.codec is not None else None)
        self.stops = StopStrings(req.stop)
        self.token_ids: list[int] = []
        self.text = ""
        self._finish: str | None = None
        self.cut = False  # this side ended the answer (a stop string, a single tool call)
        self.tools: ToolCallParser | None = None
        spec = req.tools
        markers = Markers.of(model.codec) if spec is not None and spec.parse else None
        if spec is not None and markers is not None and model.codec is not None:
            self.tools = ToolCallParser(model.codec, markers, single=not spec.parallel)
        # (tokens taken so far, delta): each tool-call delta with the step that made it
        self.tool_deltas: list[tuple[int, dict[str, Any]]] = []

    @property
    def finish(self) -> str | None:
        return self._finish

    @finish.setter
    def finish(self, reason: str | None) -> None:
        if reason == "stop" and self.tools is not None and self.tools.calls:
            reason = "tool_calls"
        self._finish = reason

    @property
    def stopped_by_string(self) -> bool:
        return self.cut

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.tools.calls if self.tools is not None else []

    def pop_tool_deltas(self, upto: int) -> list[dict[str, Any]]:
        """The tool-call deltas of the first ``upto`` tokens not yet taken."""
        n = 0
        while n < len(self.tool_deltas) and self.tool_deltas[n][0] <= upto:
            n += 1
        taken, self.tool_deltas = self.tool_deltas[:n], self.tool_deltas[n:]
        return [d for _, d in taken]

    def _emit(self, delta: str) -> str:
        if len(self.token_ids) <= self.req.min_tokens:
            # As vLLM: no stop string ends the text before min_tokens tokens (the engine
            # holds stop ids back as long).
            self.text += delta
            return delta
        out, hit = self.stops.feed(delta)
        if hit:
            self.finish = "stop"
            self.cut = True
        self.text += out
        return out

    def _content_tail(self) -> str:
        out = self._emit(self.detok.flush() if self.detok else "")
        if self.finish is None:
            held = self.stops.flush()
            self.text += held
            out += held
        return out

    def _tail(self, cut: bool = False) -> str:
        if self.tools is None or not self.tools.active:
            return self._content_tail()
        text, deltas = self.tools.end(cut)
        return self._tool_result(text, deltas)

    def _tool_result(self, text: str, deltas: list[dict[str, Any]]) -> str:
        self.text += text
        self.tool_deltas.extend((len(self.token_ids), d) for d in deltas)
        return text

    def _tool_token(self, token: int) -> str:
        assert self.tools is not None
        out = ""
        if not self.tools.active:  # the block begins: the content before it is final
            out = self._content_tail()
            if self.finish is not None:
                return out
        out += self._tool_result(*self.tools.feed(token))
        if self.tools.done:
            self.finish = "stop"
            self.cut = True
        return out

    def add(self, token: int) -> str:
        """Take one token; returns the text to show now. Sets `finish` when the request ends."""
        self.token_ids.append(token)
        if token in self.req.local_stop_ids:
            out = self._tail()
            self.finish = "stop"
            return out
        if self.tools is not None and (self.tools.active
                                       or token == self.tools.m.calls_begin):
            out = self._tool_token(token)
        else:
            out = self._emit(self.detok.add(token) if self.detok else "")
        if self.finish is None and len(self.token_ids) >= self.req.max_tokens:
            out += self._tail(cut=True)
            self.finish = self.finish or "length"
        return out

    def end(self, upstream_finish: Any) -> str:
        """The upstream finished before this side decided to (an instance-side stop), or
        generated nothing at all (an echo with max_tokens 0: nothing to flush, the
        detokenizer holds only the prompt)."""
        out = self._tail(cut=upstream_finish == "length") if self.token_ids else ""
        if self.finish is None:
            self.finish = upstream_finish if upstream_finish in ("stop", "length") else (
                "stop" if self.token_ids and self.token_ids[-1] in self.req.local_stop_ids
                else "length")
        return out
