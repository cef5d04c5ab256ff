"""The completion as the client sees it, built token by token from what the decode streams.

Text, stop strings and the finish reason are decided on the router's side: a stop string may
span tokens, and only the detokenized text shows where it begins.
"""

from __future__ import annotations

from typing import Any

from pdd_sidecar.serve.openai_request import GenRequest
from pdd_sidecar.serve.text import IncrementalDetokenizer, ModelText, StopStrings


class Output:
    """The completion as the client sees it: token ids, text, why it finished."""

    def __init__(self, req: GenRequest, model: ModelText) -> None:
        self.req = req
        self.detok = (IncrementalDetokenizer(model.codec, req.prompt_ids)
                      if model.codec is not None else None)
        self.stops = StopStrings(req.stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish: str | None = None

    @property
    def stopped_by_string(self) -> bool:
        return self.finish == "stop" and self.stops.hit

    def _emit(self, delta: str) -> str:
        if len(self.token_ids) <= self.req.min_tokens:
            # As vLLM: no stop string ends the text before min_tokens tokens (the engine
            # holds stop ids back as long).
            self.text += delta
            return delta
        out, hit = self.stops.feed(delta)
        if hit:
            self.finish = "stop"
        self.text += out
        return out

    def _tail(self) -> str:
        out = self._emit(self.detok.flush() if self.detok else "")
        if self.finish is None:
            held = self.stops.flush()
            self.text += held
            out += held
        return out

    def add(self, token: int) -> str:
        """Take one token; returns the text to show now. Sets `finish` when the request ends."""
        self.token_ids.append(token)
        if token in self.req.local_stop_ids:
            out = self._tail()
            self.finish = "stop"
            return out
        out = self._emit(self.detok.add(token) if self.detok else "")
        if self.finish is None and len(self.token_ids) >= self.req.max_tokens:
            out += self._tail()
            self.finish = self.finish or "length"
        return out

    def end(self, upstream_finish: Any) -> str:
        """The upstream finished before this side decided to (an instance-side stop)."""
        out = self._tail()
        if self.finish is None:
            self.finish = upstream_finish if upstream_finish in ("stop", "length") else (
                "stop" if self.token_ids and self.token_ids[-1] in self.req.local_stop_ids
                else "length")
        return out
