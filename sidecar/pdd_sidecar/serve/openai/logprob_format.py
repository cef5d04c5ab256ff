"""Log-probabilities in OpenAI's shapes, from the entries the instances send.

Why here: the instances speak token ids (``[logprob, rank, [[id, logprob], ...]]`` per token,
instance/common.py); only the router has the tokenizer that turns ids into the token strings the
client reads. The numbers are the model's raw distribution (before logit_bias, penalties,
temperature, top-k and top-p), as vLLM's default ``raw_logprobs`` mode gives them.

Completions (``logprobs: k``): ``{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}``, the chosen token in each ``top_logprobs`` dict beside the k likeliest (as vLLM),
and an echoed prompt's first token with nulls. Chat (``logprobs: true``, ``top_logprobs: k``):
``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``. vLLM's
``prompt_logprobs``: ``[null, {"id": {logprob, rank, decoded_token}}, ...]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# What an instance sends per token (None: the prompt's first token, which nothing predicts).
Entry = Sequence[Any] | None


def entry_ok(value: Any) -> bool:
    """An instance's entry is well formed (the router checks what it relays)."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[2], list)):
        return False
    lp, rank, top = value
    return (_number(lp) and isinstance(rank, int) and not isinstance(rank, bool)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
                    and _number(p[1]) for p in top))


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class LogprobText:
    """Token strings for one request's log-probabilities, and the running text offset of a
    completion's ``text_offset`` (a stream's chunks continue where the last one ended).
    ``as_ids``: vLLM's ``return_tokens_as_token_ids`` (``"token_id:5"``)."""

    def __init__(self, decode: Callable[[list[int]], str] | None, as_ids: bool = False) -> None:
        self.decode = decode
        self.as_ids = as_ids or decode is None
        self.offset = 0

    def token(self, tid: int) -> str:
        if self.as_ids or self.decode is None:
            return f"token_id:{tid}"
        return self.decode([tid])

    def completion(self, ids: Sequence[int], entries: Sequence[Entry]) -> dict[str, Any]:
        """OpenAI's completions ``logprobs`` object for ``ids`` (an echoed prompt's tokens
        first, its first entry None)."""
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, e in zip(ids, entries, strict=True):
            s = self.token(tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lp, _, top = e
            lps.append(lp)
            d = {self.token(t): v for t, v in top}
            d.setdefault(s, lp)
            tops.append(d)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _item(self, tid: int, lp: float) -> dict[str, Any]:
        s = self.token(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def chat(self, ids: Sequence[int], entries: Sequence[Entry]) -> dict[str, Any]:
        """OpenAI's chat ``logprobs`` object (``{"content": [...]}``) for generated ``ids``."""
        content = []
        for tid, e in zip(ids, entries, strict=True):
            assert e is not None
            lp, _, top = e
            content.append({**self._item(tid, lp),
                            "top_logprobs": [self._item(t, v) for t, v in top]})
        return {"content": content}

    def prompt_logprobs(self, ids: Sequence[int], entries: Sequence[Entry]) -> list[Any]:
        """vLLM's ``prompt_logprobs``: per prompt token (the first: null) its own entry and
        the top ones, by token id."""
        out: list[Any] = []
        for tid, e in zip(ids, entries, strict=True):
            if e is None:
                out.append(None)
                continue
            lp, rank, top = e
            d = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.token(t)}
                 for r, (t, v) in enumerate(top)}
            d[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": self.token(tid)}
            out.append(d)
        return out


def with_first_null(entries: Sequence[Entry]) -> list[Entry]:
    """A prompt's entries as the instances send them (from its second token on) with the
    first token's null in front."""
    return [None, *entries]
